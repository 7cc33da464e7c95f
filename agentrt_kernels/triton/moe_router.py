"""MoE router epilogue: fp32 softmax + top-k (+ optional renormalisation) of the router logits, fused.

``route_topk(router_logits, top_k, renormalize) -> (topk_ids, topk_weights)``
    router_logits: [T, E] fp32 / fp16 / bf16 (last dim contiguous, row stride free)
    top_k:         K, 1 <= K <= E
    renormalize:   divide the K chosen probabilities by their sum (HF ``norm_topk_prob``)
    topk_ids:      [T, K] int64, the chosen experts by descending probability
    topk_weights:  [T, K] in router_logits.dtype

Matches agentrt_kernels.torch_ref.moe_router.route_topk (F.softmax in fp32, torch.topk, optional divide by the
sum, cast to the logits' dtype) in one launch instead of ~5 small kernels. Grid (T,): one program per
token loads the E logits as one fp32 tile of next_pow2(E) lanes (padding -inf), takes the row max m and
the full-row sum S = sum exp(l - m), then runs K rounds of argmax over the experts not yet chosen (a
round takes the max of what is left and the LOWEST index holding it, so exact ties go to the lower
expert id; torch.topk leaves tie order unspecified). Probabilities are monotone in the logits, so
picking by logit picks what torch.topk picks from the softmax. The weights are exp(l_k - m) / D in fp32,
D = S, or the sum over the K chosen when renormalising (the 1/S of softmax cancels), rounded once to the
logits' dtype. Outputs are allocated from shapes alone: no host sync, CUDA-graph capturable.

``route_grouped_sigmoid(router_logits, correction_bias, top_k, groups, topk_groups, renormalize, scaling,
out_dtype) -> (topk_ids, topk_weights)``
    router_logits:   [T, E] fp32 / fp16 / bf16 (last dim contiguous, row stride free)
    correction_bias: [E] fp32, added to the scores to choose experts, never to weight them
    groups:          G contiguous groups of E // G experts (1: no group stage); 1 <= topk_groups <= G
    topk_ids:        [T, K] int64, the chosen experts by descending bias-corrected score
    topk_weights:    [T, K] in out_dtype

Matches agentrt_kernels.torch_ref.moe_router.route_grouped_sigmoid (DeepSeek-V3's router after the gate
GEMM: sigmoid, bias, group top-2 scores, group top-k, mask, top-k, gather, renormalise, scale, cast) in one
launch instead of ~15 small kernels. Grid (T,): one program per token loads the E logits as one fp32
[next_pow2(G), next_pow2(E // G)] tile, one group per tile row, so the group stage is a row reduction:
a group's score is its row max plus the max of the row with the first lane holding that max taken out
(a max held twice scores 2 * max, as torch.topk(2) gives). topk_groups rounds of argmax over the group
scores not yet kept (lowest group on exact ties) pick the groups, the other rows drop to -inf, and K
rounds of argmax over the experts not yet chosen pick the experts exactly as ``route_topk`` does (lowest
expert id on exact ties; "left" tracked apart from the values so -inf choices can still fill the K).
The weights are the chosen experts' sigmoid scores, divided by their sum + 1e-20 when renormalising and
times ``scaling``, in fp32, rounded once to out_dtype. Outputs are allocated from shapes alone: no host
sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2

_MAX_EXPERTS = 65536  # one tile per row
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _route_topk_kernel(
    logits_ptr, ids_ptr, w_ptr,
    stride_l, stride_i, stride_w,
    E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
    row_max = tl.max(logits, 0)
    total = tl.sum(tl.where(valid, tl.exp(logits - row_max), 0.0), 0)

    kcols = tl.arange(0, BLOCK_K)
    sel_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    sel_logits = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    # "left" tracks the experts not yet chosen separately from the values, so logits that are -inf
    # themselves can still be chosen (once each) when fewer than K finite ones remain.
    left = valid
    for k in range(TOP_K):
        cand = tl.where(left, logits, float("-inf"))
        best = tl.max(cand, 0)
        idx = tl.min(tl.where(left & (cand == best), cols, BLOCK_E), 0)  # lowest index on ties
        sel_ids = tl.where(kcols == k, idx, sel_ids)
        sel_logits = tl.where(kcols == k, best, sel_logits)
        left = left & (cols != idx)

    kmask = kcols < TOP_K
    sel_exp = tl.where(kmask, tl.exp(sel_logits - row_max), 0.0)
    if RENORMALIZE:
        denom = tl.sum(sel_exp, 0)
    else:
        denom = total
    weights = sel_exp / denom
    tl.store(ids_ptr + row * stride_i + kcols, sel_ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + row * stride_w + kcols, weights.to(w_ptr.dtype.element_ty), mask=kmask)


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in router_logits.dtype)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [tokens, experts], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"router_logits must be float32, float16 or bfloat16, got {router_logits.dtype}")
    tokens, experts = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int with 1 <= top_k <= num_experts ({experts}), got {top_k!r}")
    if experts > _MAX_EXPERTS:
        raise ValueError(f"at most {_MAX_EXPERTS} experts fit one tile, got {experts}")
    check_last_dim_contiguous("router_logits", router_logits)
    device = router_logits.device
    topk_ids = torch.empty((tokens, top_k), dtype=torch.int64, device=device)
    topk_weights = torch.empty((tokens, top_k), dtype=router_logits.dtype, device=device)
    if tokens == 0:
        return topk_ids, topk_weights
    block_e = next_pow2(experts)
    _route_topk_kernel[(tokens,)](
        router_logits, topk_ids, topk_weights,
        router_logits.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        E=experts, BLOCK_E=block_e, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
        RENORMALIZE=bool(renormalize),
        num_warps=max(1, min(8, block_e // 256)),
    )
    return topk_ids, topk_weights


@triton.jit
def _route_grouped_sigmoid_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr,
    stride_l, stride_b, stride_i, stride_w, scaling, shared_expert,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gcols = tl.arange(0, BLOCK_G)
    scols = tl.arange(0, BLOCK_S)
    expert = gcols[:, None] * GROUP_SIZE + scols[None, :]
    # padding lanes past a group's end alias the next group's expert ids, so every use of "expert" is masked
    valid = (gcols[:, None] < GROUPS) & (scols[None, :] < GROUP_SIZE)
    logits = tl.load(logits_ptr + row * stride_l + expert, mask=valid, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + expert * stride_b, mask=valid, other=0.0)
    scores = tl.sigmoid(logits)
    choice = tl.where(valid, scores + bias, float("-inf"))

    if GROUPS > 1:
        top1 = tl.max(choice, 1)
        first = tl.min(tl.where(choice == top1[:, None], scols[None, :], BLOCK_S), 1)
        top2 = tl.max(tl.where(scols[None, :] == first[:, None], float("-inf"), choice), 1)
        group_scores = top1 + top2
        gleft = gcols < GROUPS
        keep = gcols < 0
        for _ in range(TOPK_GROUPS):
            cand = tl.where(gleft, group_scores, float("-inf"))
            best = tl.max(cand, 0)
            gidx = tl.min(tl.where(gleft & (cand == best), gcols, BLOCK_G), 0)  # lowest group on ties
            keep = keep | (gcols == gidx)
            gleft = gleft & (gcols != gidx)
        choice = tl.where(keep[:, None], choice, float("-inf"))

    kcols = tl.arange(0, BLOCK_K)
    sel_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    sel_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    left = valid
    for k in range(TOP_K):
        cand = tl.where(left, choice, float("-inf"))
        best = tl.max(tl.max(cand, 1), 0)
        idx = tl.min(tl.min(tl.where(left & (cand == best), expert, GROUPS * GROUP_SIZE), 1), 0)
        hit = valid & (expert == idx)
        score = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)  # one lane: exact
        sel_ids = tl.where(kcols == k, idx, sel_ids)
        sel_w = tl.where(kcols == k, score, sel_w)
        left = left & ~hit

    kmask = kcols < TOP_K
    if RENORMALIZE:
        sel_w = sel_w / (tl.sum(sel_w, 0) + 1e-20)
    sel_w = sel_w * scaling
    tl.store(ids_ptr + row * stride_i + kcols, sel_ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + row * stride_w + kcols, sel_w.to(w_ptr.dtype.element_ty), mask=kmask)
    if SHARED:  # column K: the shared expert, weight 1, for every token
        tl.store(ids_ptr + row * stride_i + TOP_K, shared_expert)
        tl.store(w_ptr + row * stride_w + TOP_K, tl.full([], 1.0, tl.float32).to(w_ptr.dtype.element_ty))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def route_grouped_sigmoid(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int, topk_groups: int,
    renormalize: bool, scaling: float, out_dtype: torch.dtype, shared_expert: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in out_dtype), DeepSeek-V3 routing;
    with ``shared_expert``, [T, K + 1]: a last column of that id, weight 1."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [tokens, experts], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"router_logits must be float32, float16 or bfloat16, got {router_logits.dtype}")
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    tokens, experts = router_logits.shape
    if not _is_int(top_k) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int with 1 <= top_k <= num_experts ({experts}), got {top_k!r}")
    if not _is_int(groups) or groups < 1 or experts % groups:
        raise ValueError(f"groups must be a positive int dividing num_experts ({experts}), got {groups!r}")
    group_size = experts // groups
    if groups > 1 and group_size < 2:
        raise ValueError(f"groups must leave at least 2 experts per group (scored by their top 2), got {groups}")
    if not _is_int(topk_groups) or not 1 <= topk_groups <= groups:
        raise ValueError(f"topk_groups must be an int with 1 <= topk_groups <= groups ({groups}), got {topk_groups!r}")
    if topk_groups * group_size < top_k:
        raise ValueError(f"topk_groups ({topk_groups}) groups of {group_size} experts cannot hold top_k ({top_k})")
    if experts > _MAX_EXPERTS:
        raise ValueError(f"at most {_MAX_EXPERTS} experts fit one tile, got {experts}")
    check_last_dim_contiguous("router_logits", router_logits)
    if correction_bias.shape != (experts,) or correction_bias.dtype != torch.float32:
        raise ValueError(f"correction_bias must be float32 of shape ({experts},), got {correction_bias.dtype} "
                         f"{tuple(correction_bias.shape)}")
    if correction_bias.device != router_logits.device:
        raise ValueError(f"correction_bias must be on {router_logits.device}, got {correction_bias.device}")
    if shared_expert is not None and (not _is_int(shared_expert) or shared_expert < 0):
        raise ValueError(f"shared_expert must be None or a non-negative int, got {shared_expert!r}")
    device = router_logits.device
    columns = top_k + (shared_expert is not None)
    topk_ids = torch.empty((tokens, columns), dtype=torch.int64, device=device)
    topk_weights = torch.empty((tokens, columns), dtype=out_dtype, device=device)
    if tokens == 0:
        return topk_ids, topk_weights
    block_g, block_s = next_pow2(groups), next_pow2(group_size)
    _route_grouped_sigmoid_kernel[(tokens,)](
        router_logits, correction_bias, topk_ids, topk_weights,
        router_logits.stride(0), correction_bias.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        float(scaling), -1 if shared_expert is None else shared_expert,
        GROUPS=groups, GROUP_SIZE=group_size, BLOCK_G=block_g, BLOCK_S=block_s,
        TOPK_GROUPS=topk_groups, TOP_K=top_k, BLOCK_K=next_pow2(top_k), RENORMALIZE=bool(renormalize),
        SHARED=shared_expert is not None,
        num_warps=max(1, min(8, block_g * block_s // 256)),
    )
    return topk_ids, topk_weights
