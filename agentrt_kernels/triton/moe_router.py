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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter

_MAX_EXPERTS = 65536  # one tile per row


@triton.jit
def _route_topk_kernel(
    logits_ptr, ids_ptr, w_ptr,
    stride_l, stride_i, stride_w,
    E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
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
        num_warps=max(1, min(8, block_e // 256)), PDL=(on := pdl(device)), launch_pdl=on,
    )
    return topk_ids, topk_weights
