"""DeepSeek-V3's MoE router (GLM-4.7-Flash, Kimi K2) after or with its fp32 gate product, in one launch.

``route_grouped_sigmoid(router_logits, correction_bias, top_k, groups, topk_groups, renormalize, scaling,
out_dtype, shared_expert=None) -> (topk_ids, topk_weights)``
    router_logits:   [T, E] fp32 / fp16 / bf16 (last dim contiguous, row stride free)
    correction_bias: [E] fp32, added to the scores to choose experts, never to weight them
    groups:          G contiguous groups of E // G experts (1: no group stage); 1 <= topk_groups <= G
    shared_expert:   an id appended to every row with weight 1 (a shared expert run with the routed ones)
    topk_ids:        [T, K] int64 ([T, K + 1] with shared_expert), the chosen experts by descending
                     bias-corrected score
    topk_weights:    same shape, in out_dtype

``route_grouped_sigmoid_from_hidden(x, gate_weight, correction_bias, ...)`` takes the hidden rows x [T, H] and the
fp32 gate weight [E, H] instead of the logits and computes each row's logits in the same program (fp32 products
of x's values, summed in fp32): the cast of x and the gate GEMM are not launches of their own. Each program reads
the whole gate weight, so ``hidden_route_fits`` keeps it to a few rows of a small gate (a decode step's): L2 serves
the re-reads.

Matches agentrt_kernels.torch_ref.moe_router.route_grouped_sigmoid (DeepSeek-V3's router after the gate
GEMM: sigmoid, bias, group top-2 scores, group top-k, mask, top-k, gather, renormalise, scale, cast) in one
launch instead of ~10-15 small kernels. Grid (T,): one program per token holds the E logits as one fp32
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
_TILE = 8192  # elements of one gate-weight tile [groups, group size, hidden block] in a program's registers
HIDDEN_ROUTE_MAX_ROWS = 32
HIDDEN_ROUTE_MAX_GATE = 1 << 20  # gate elements (E x H): 4 MiB of fp32 each row's program reads


def hidden_route_fits(tokens: int, experts: int, hidden: int) -> bool:
    """Whether ``route_grouped_sigmoid_from_hidden`` serves this shape: a few rows over a small gate (GLM-4.7-Flash's
    64 x 2048 at a decode step), where each row's program re-reading the whole gate weight stays in L2; larger
    ones take the gate GEMM and ``route_grouped_sigmoid``."""
    return 0 < tokens <= HIDDEN_ROUTE_MAX_ROWS and experts * hidden <= HIDDEN_ROUTE_MAX_GATE


@triton.jit
def _route_grouped_sigmoid_kernel(
    logits_ptr, x_ptr, gate_ptr, bias_ptr, ids_ptr, w_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr,
    stride_l, stride_x, stride_g, stride_b, stride_i, stride_w, stride_r, stride_ro, stride_n, hidden, scaling,
    shared_expert, eps,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr, FROM_HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gcols = tl.arange(0, BLOCK_G)
    scols = tl.arange(0, BLOCK_S)
    expert = gcols[:, None] * GROUP_SIZE + scols[None, :]
    # padding lanes past a group's end alias the next group's expert ids, so every use of "expert" is masked
    valid = (gcols[:, None] < GROUPS) & (scols[None, :] < GROUP_SIZE)
    if FROM_HIDDEN:  # the row's logits: x . gate[e] in fp32, BLOCK_H hidden columns at a time
        hcols = tl.arange(0, BLOCK_H)
        if NORM:  # the residual sum (rounded to x's dtype, as torch adds) and its mean square, the whole row at once
            cols = tl.arange(0, BLOCK_ROW)
            c_mask = cols < hidden
            s = (tl.load(x_ptr + row * stride_x + cols, mask=c_mask, other=0.0).to(tl.float32)
                 + tl.load(res_ptr + row * stride_r + cols, mask=c_mask, other=0.0).to(tl.float32))
            s = s.to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, s, mask=c_mask)
            sf = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sf * sf, 0) / hidden + eps)
        logits = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)
        rows = gate_ptr + expert.to(tl.int64)[:, :, None] * stride_g
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + hcols
            h_mask = h < hidden
            if NORM:  # RMSNorm's rounding: normalised in fp32, rounded, times the weight in fp32, rounded
                part = (tl.load(x_ptr + row * stride_x + h, mask=h_mask, other=0.0).to(tl.float32)
                        + tl.load(res_ptr + row * stride_r + h, mask=h_mask, other=0.0).to(tl.float32))
                part = part.to(x_ptr.dtype.element_ty).to(tl.float32)
                nh = (part * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
                nw = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
                normed = (nh * nw).to(normed_ptr.dtype.element_ty)
                tl.store(normed_ptr + row * stride_n + h, normed, mask=h_mask)
                xv = normed.to(tl.float32)
            else:
                xv = tl.load(x_ptr + row * stride_x + h, mask=h_mask, other=0.0).to(tl.float32)
            gv = tl.load(rows + h[None, None, :], mask=valid[:, :, None] & h_mask[None, None, :], other=0.0)
            logits += tl.sum(gv * xv[None, None, :], 2)
    else:
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


def _check_routing(tokens_device: torch.device, experts: int, correction_bias: torch.Tensor, top_k: int,
                   groups: int, topk_groups: int, out_dtype: torch.dtype, shared_expert: int | None) -> None:
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
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
    if correction_bias.shape != (experts,) or correction_bias.dtype != torch.float32:
        raise ValueError(f"correction_bias must be float32 of shape ({experts},), got {correction_bias.dtype} "
                         f"{tuple(correction_bias.shape)}")
    if correction_bias.device != tokens_device:
        raise ValueError(f"correction_bias must be on {tokens_device}, got {correction_bias.device}")
    if shared_expert is not None and (not _is_int(shared_expert) or shared_expert < 0):
        raise ValueError(f"shared_expert must be None or a non-negative int, got {shared_expert!r}")


def _launch(logits, x, gate, hidden, correction_bias, tokens, experts, top_k, groups, topk_groups, renormalize,
            scaling, out_dtype, shared_expert, from_hidden, norm=None):
    """``norm``: (residual, norm weight, eps, residual_out, normed), the rows' RMSNorm before the gate product."""
    device = correction_bias.device
    columns = top_k + (shared_expert is not None)
    topk_ids = torch.empty((tokens, columns), dtype=torch.int64, device=device)
    topk_weights = torch.empty((tokens, columns), dtype=out_dtype, device=device)
    if tokens == 0:
        return topk_ids, topk_weights
    group_size = experts // groups
    block_g, block_s = next_pow2(groups), next_pow2(group_size)
    block_h = max(16, min(128, _TILE // (block_g * block_s))) if from_hidden else 16
    residual, norm_weight, eps, residual_out, normed = norm if norm is not None else (x, x, 0.0, x, x)
    _route_grouped_sigmoid_kernel[(tokens,)](
        logits, x, gate, correction_bias, topk_ids, topk_weights, residual, norm_weight, residual_out, normed,
        logits.stride(0), x.stride(0), gate.stride(0), correction_bias.stride(0), topk_ids.stride(0),
        topk_weights.stride(0), residual.stride(0), residual_out.stride(0), normed.stride(0), hidden,
        float(scaling), -1 if shared_expert is None else shared_expert, float(eps),
        GROUPS=groups, GROUP_SIZE=group_size, BLOCK_G=block_g, BLOCK_S=block_s,
        TOPK_GROUPS=topk_groups, TOP_K=top_k, BLOCK_K=next_pow2(top_k), RENORMALIZE=bool(renormalize),
        SHARED=shared_expert is not None, FROM_HIDDEN=from_hidden, BLOCK_H=block_h, NORM=norm is not None,
        BLOCK_ROW=next_pow2(hidden) if norm is not None else 16,
        num_warps=4 if from_hidden else max(1, min(8, block_g * block_s // 256)),
    )
    return topk_ids, topk_weights


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
    tokens, experts = router_logits.shape
    _check_routing(router_logits.device, experts, correction_bias, top_k, groups, topk_groups, out_dtype,
                   shared_expert)
    check_last_dim_contiguous("router_logits", router_logits)
    return _launch(router_logits, router_logits, router_logits, 0, correction_bias, tokens, experts, top_k, groups,
                   topk_groups, renormalize, scaling, out_dtype, shared_expert, from_hidden=False)


def route_grouped_sigmoid_from_hidden(
    x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int,
    topk_groups: int, renormalize: bool, scaling: float, out_dtype: torch.dtype, shared_expert: int | None = None,
    *, norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``route_grouped_sigmoid`` of the logits ``x.float() @ gate_weight.T`` (x [T, H]; gate_weight [E, H] fp32),
    computed in the same launch. With ``norm`` = (weight [H] in x's dtype, eps) and ``residual`` [T, H]: the
    logits of ``rms_norm(x + residual)`` (``agentrt_kernels.triton.norm``'s math and rounding), returned with the
    normed rows and the new residual: (topk_ids, topk_weights, normed, x + residual)."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be 2-D [tokens, hidden] float32, float16 or bfloat16, got {tuple(x.shape)} "
                         f"{x.dtype}")
    tokens, hidden = x.shape
    if gate_weight.dim() != 2 or gate_weight.shape[1] != hidden or gate_weight.dtype != torch.float32:
        raise ValueError(f"gate_weight must be float32 [experts, {hidden}], got {tuple(gate_weight.shape)} "
                         f"{gate_weight.dtype}")
    experts = gate_weight.shape[0]
    _check_routing(x.device, experts, correction_bias, top_k, groups, topk_groups, out_dtype, shared_expert)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("gate_weight", gate_weight)
    if (norm is None) != (residual is None):
        raise ValueError("norm and residual go together")
    fused = None
    if norm is not None:
        weight, eps = norm
        if weight.shape != (hidden,) or weight.dtype != x.dtype:
            raise ValueError(f"norm weight must be [{hidden}] in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
        check_last_dim_contiguous("residual", residual)
        fused = (residual, weight, eps, torch.empty_like(x, memory_format=torch.contiguous_format),
                 torch.empty_like(x, memory_format=torch.contiguous_format))
    ids, weights = _launch(x, x, gate_weight, hidden, correction_bias, tokens, experts, top_k, groups, topk_groups,
                           renormalize, scaling, out_dtype, shared_expert, from_hidden=True, norm=fused)
    return (ids, weights) if fused is None else (ids, weights, fused[4], fused[3])
