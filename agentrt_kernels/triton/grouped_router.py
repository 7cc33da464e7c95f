"""DeepSeek-V3's MoE router (GLM-4.7-Flash, Kimi K2) after its fp32 gate product in one launch, or with it in two.

``route_grouped_sigmoid(router_logits, correction_bias, top_k, groups, topk_groups, renormalize, scaling,
out_dtype, shared_expert=None) -> (topk_ids, topk_weights)``
    router_logits:   [T, E] fp32 / fp16 / bf16 (last dim contiguous, row stride free)
    correction_bias: [E] fp32, added to the scores to choose experts, never to weight them
    groups:          G contiguous groups of E // G experts (1: no group stage); 1 <= topk_groups <= G
    shared_expert:   an id appended to every row with weight 1 (a shared expert run with the routed ones)
    topk_ids:        [T, K] int64 ([T, K + 1] with shared_expert), the chosen experts by descending
                     bias-corrected score
    topk_weights:    same shape, in out_dtype

``route_grouped_sigmoid_from_hidden(x, gate_weight, correction_bias, ..., norm=None, residual=None)`` takes the hidden
rows x [T, H] and the fp32 gate weight [E, H] instead of the logits, for a decode step's few rows: the cast of x and
the gate GEMM are not launches of their own. A first launch splits the hidden dim over programs (grid H / BLOCK_H):
each multiplies its slice of every row with its [E, BLOCK_H] slice of the gate (fp32 products, summed in fp32 by an
IEEE-precision dot) into partial logits [T, H / BLOCK_H, E]; the routing launch sums a row's partials (a fixed order:
the same logits every run). The gate is read once, by many SMs at once (one program a token reading the whole gate
left a decode step to as many SMs as it has rows: the profile in docs/benchmarks.md, 2026-12-07).
With ``norm`` and ``residual`` the first launch also takes the rows' RMSNorm (``agentrt_kernels.triton.norm``'s math
and rounding) of x + residual: every program reads the whole rows for their mean squares (L2-resident), then writes
its slice of the new residual and of the normed rows, which it multiplies.

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

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter

_MAX_EXPERTS = 65536  # one tile per row
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 8192  # elements of one tile in a program's registers
HIDDEN_ROUTE_MAX_ROWS = 32
HIDDEN_ROUTE_MAX_GATE = 1 << 20  # gate elements (E x H): the partial-logit programs' [E, GATE_BLOCK_H] slices
GATE_BLOCK_H = 64  # hidden columns a partial-logit program takes: 32 programs over GLM-4.7-Flash's 2048
GATE_MAX_BLOCK_E = 128  # experts of one gate tile: up to this many, the program reads its gate slice in one load
_MAX_UNROLLED_CHUNKS = 16  # wider rows loop over their chunks (code size)


def hidden_route_fits(tokens: int, experts: int, hidden: int) -> bool:
    """Whether ``route_grouped_sigmoid_from_hidden`` serves this shape: a decode step's few rows (one dot tile of
    them) over a small gate (GLM-4.7-Flash's 64 x 2048); larger ones take the gate GEMM and
    ``route_grouped_sigmoid``."""
    return 0 < tokens <= HIDDEN_ROUTE_MAX_ROWS and experts * hidden <= HIDDEN_ROUTE_MAX_GATE


def gate_launch(tokens: int) -> dict:
    """The partial-logit launch for this many rows: elements of one (unrolled) chunk of the rows the fused norm
    reads for its mean squares, and warps -- 4 for one dot tile of 16 rows, 8 for more (the fastest of
    ``benchmarks.router_kernels`` at 8 and 32 rows, docs/benchmarks.md)."""
    return {"norm_tile": 4096, "num_warps": 4 if tokens <= 16 else 8}


@triton.jit
def _chunk_squares(x_ptr, res_ptr, rows, t_mask, c0, hidden, stride_x, stride_r, CHUNK: tl.constexpr):
    """The squares of (x + residual) over columns [c0, c0 + CHUNK) of each row, the sum rounded to x's dtype."""
    c = c0 + tl.arange(0, CHUNK)
    cm = t_mask[:, None] & (c < hidden)[None, :]
    a = (tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=cm, other=0.0).to(tl.float32)
         + tl.load(res_ptr + rows[:, None] * stride_r + c[None, :], mask=cm, other=0.0).to(tl.float32))
    a = a.to(x_ptr.dtype.element_ty).to(tl.float32)
    return a * a


@triton.jit
def _gate_partials_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, gate_ptr, part_ptr,
    tokens, hidden, eps, stride_x, stride_r, stride_ro, stride_n, stride_g, stride_pt, stride_ps,
    E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, MAX_UNROLLED_CHUNKS: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    split = tl.program_id(0)
    hh = split * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hh < hidden
    # every load this program makes is issued before any is waited on: the gate slice (HBM) when one tile holds
    # all experts (a weight: issued even before the wait for the previous kernel), this slice of the rows, and
    # (NORM) the whole rows for their mean squares in unrolled chunks (L2), so the program waits about one
    # memory round trip rather than one per chunk
    ee0 = tl.arange(0, BLOCK_E)
    if E <= BLOCK_E:
        g0 = tl.load(gate_ptr + ee0.to(tl.int64)[:, None] * stride_g + hh[None, :],
                     mask=(ee0 < E)[:, None] & h_mask[None, :], other=0.0)
    pdl_enter(PDL)
    tt = tl.arange(0, BLOCK_T)
    t_mask = tt < tokens
    rows = tt.to(tl.int64)
    mask = t_mask[:, None] & h_mask[None, :]
    xv = tl.load(x_ptr + rows[:, None] * stride_x + hh[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:  # the residual sum (rounded to x's dtype, as torch adds), normalised by the whole row's mean square
        rv = tl.load(res_ptr + rows[:, None] * stride_r + hh[None, :], mask=mask, other=0.0).to(tl.float32)
        # the squares summed lane-wise over the chunks, then once across a row (no reduction between loads)
        sq = tl.zeros([BLOCK_T, CHUNK], dtype=tl.float32)
        if NUM_CHUNKS <= MAX_UNROLLED_CHUNKS:
            for i in tl.static_range(NUM_CHUNKS):
                sq += _chunk_squares(x_ptr, res_ptr, rows, t_mask, i * CHUNK, hidden, stride_x, stride_r, CHUNK)
        else:  # rows too wide to unroll: one chunk after another
            for c0 in range(0, hidden, CHUNK):
                sq += _chunk_squares(x_ptr, res_ptr, rows, t_mask, c0, hidden, stride_x, stride_r, CHUNK)
        rstd = tl.rsqrt(tl.sum(sq, 1) / hidden + eps)
        sv = (xv + rv).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_ro + hh[None, :], sv, mask=mask)
        nh = (sv.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + hh, mask=h_mask, other=0.0).to(tl.float32)
        normed = (nh * nw[None, :]).to(normed_ptr.dtype.element_ty)
        tl.store(normed_ptr + rows[:, None] * stride_n + hh[None, :], normed, mask=mask)
        xv = normed.to(tl.float32)
    if E <= BLOCK_E:
        part = tl.dot(xv, tl.trans(g0), input_precision="ieee")  # [BLOCK_T, BLOCK_E]
        tl.store(part_ptr + rows[:, None] * stride_pt + split * stride_ps + ee0[None, :], part,
                 mask=t_mask[:, None] & (ee0 < E)[None, :])
    else:
        for e0 in range(0, E, BLOCK_E):
            ee = e0 + ee0
            e_mask = ee < E
            g = tl.load(gate_ptr + ee.to(tl.int64)[:, None] * stride_g + hh[None, :],
                        mask=e_mask[:, None] & h_mask[None, :], other=0.0)
            part = tl.dot(xv, tl.trans(g), input_precision="ieee")
            tl.store(part_ptr + rows[:, None] * stride_pt + split * stride_ps + ee[None, :], part,
                     mask=t_mask[:, None] & e_mask[None, :])


@triton.jit
def _route_grouped_sigmoid_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr,
    stride_l, stride_ls, stride_b, stride_i, stride_w, splits, scaling, shared_expert,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    gcols = tl.arange(0, BLOCK_G)
    scols = tl.arange(0, BLOCK_S)
    expert = gcols[:, None] * GROUP_SIZE + scols[None, :]
    # padding lanes past a group's end alias the next group's expert ids, so every use of "expert" is masked
    valid = (gcols[:, None] < GROUPS) & (scols[None, :] < GROUP_SIZE)
    if PARTIALS:  # the row's logits: its partial sums over hidden slices [splits, E], added in a fixed order
        pp = tl.arange(0, BLOCK_P)
        logits = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)
        for p0 in range(0, splits, BLOCK_P):
            p = p0 + pp
            tile = tl.load(logits_ptr + row * stride_l + p[:, None, None] * stride_ls + expert[None, :, :],
                           mask=(p < splits)[:, None, None] & valid[None, :, :], other=0.0)
            logits += tl.sum(tile, 0)
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


def _route(logits, correction_bias, tokens, experts, top_k, groups, topk_groups, renormalize, scaling, out_dtype,
           shared_expert, splits=0):
    """The routing launch over logits [T, E], or (``splits`` > 0) over partial logits [T, splits, E]."""
    device = correction_bias.device
    columns = top_k + (shared_expert is not None)
    topk_ids = torch.empty((tokens, columns), dtype=torch.int64, device=device)
    topk_weights = torch.empty((tokens, columns), dtype=out_dtype, device=device)
    if tokens == 0:
        return topk_ids, topk_weights
    group_size = experts // groups
    block_g, block_s = next_pow2(groups), next_pow2(group_size)
    block_p = max(1, min(next_pow2(splits), _TILE // (block_g * block_s))) if splits else 1
    _route_grouped_sigmoid_kernel[(tokens,)](
        logits, correction_bias, topk_ids, topk_weights,
        logits.stride(0), logits.stride(1) if splits else 0, correction_bias.stride(0), topk_ids.stride(0),
        topk_weights.stride(0), splits, float(scaling), -1 if shared_expert is None else shared_expert,
        GROUPS=groups, GROUP_SIZE=group_size, BLOCK_G=block_g, BLOCK_S=block_s,
        TOPK_GROUPS=topk_groups, TOP_K=top_k, BLOCK_K=next_pow2(top_k), RENORMALIZE=bool(renormalize),
        SHARED=shared_expert is not None, PARTIALS=splits > 0, BLOCK_P=block_p,
        num_warps=max(1, min(8, block_g * block_s // 256)) if not splits else 4,
        PDL=(on := pdl(device)), launch_pdl=on,
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
    return _route(router_logits, correction_bias, tokens, experts, top_k, groups, topk_groups, renormalize, scaling,
                  out_dtype, shared_expert)


def route_grouped_sigmoid_from_hidden(
    x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int,
    topk_groups: int, renormalize: bool, scaling: float, out_dtype: torch.dtype, shared_expert: int | None = None,
    *, norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, ...]:
    """``route_grouped_sigmoid`` of the logits ``x.float() @ gate_weight.T`` (x [T, H], at most
    ``HIDDEN_ROUTE_MAX_ROWS``; gate_weight [E, H] fp32): partial logits over hidden slices, then the routing.
    With ``norm`` = (weight [H] in x's dtype, eps) and ``residual`` [T, H]: the logits of
    ``rms_norm(x + residual)`` (``agentrt_kernels.triton.norm``'s math and rounding), returned with the normed
    rows and the new residual: (topk_ids, topk_weights, normed, x + residual). ``launch``: the partial-logit
    launch's ``norm_tile`` (elements of one chunk of the rows the norm reads) and ``num_warps`` over
    ``gate_launch``'s (``benchmarks.router_kernels`` sweeps them)."""
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
    if norm is not None:
        weight, eps = norm
        if weight.shape != (hidden,) or weight.dtype != x.dtype:
            raise ValueError(f"norm weight must be [{hidden}] in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
        check_last_dim_contiguous("residual", residual)
    if tokens > HIDDEN_ROUTE_MAX_ROWS:
        raise ValueError(f"at most {HIDDEN_ROUTE_MAX_ROWS} rows route from hidden rows, got {tokens}")
    splits = triton.cdiv(hidden, GATE_BLOCK_H)
    partials = torch.empty((tokens, splits, experts), dtype=torch.float32, device=x.device)
    normed = new_residual = None
    if norm is not None:
        normed = torch.empty_like(x, memory_format=torch.contiguous_format)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens:
        opts = gate_launch(tokens) | (launch or {})
        block_t = max(16, next_pow2(tokens))
        chunk = min(max(16, opts["norm_tile"] // block_t), max(16, next_pow2(hidden)))
        res, nw, res_out, out = (residual, norm[0], new_residual, normed) if norm is not None else (x, x, x, x)
        _gate_partials_kernel[(splits,)](
            x, res, nw, res_out, out, gate_weight, partials,
            tokens, hidden, float(norm[1]) if norm is not None else 0.0, x.stride(0), res.stride(0),
            res_out.stride(0), out.stride(0), gate_weight.stride(0), partials.stride(0), partials.stride(1),
            E=experts, BLOCK_T=block_t, BLOCK_E=max(16, min(GATE_MAX_BLOCK_E, next_pow2(experts))),
            BLOCK_H=GATE_BLOCK_H, CHUNK=chunk, NUM_CHUNKS=triton.cdiv(hidden, chunk),
            MAX_UNROLLED_CHUNKS=_MAX_UNROLLED_CHUNKS, NORM=norm is not None,
            num_warps=opts["num_warps"], PDL=(on := pdl(x.device)), launch_pdl=on,
        )
    ids, weights = _route(partials, correction_bias, tokens, experts, top_k, groups, topk_groups, renormalize,
                          scaling, out_dtype, shared_expert, splits=splits)
    return (ids, weights) if norm is None else (ids, weights, normed, new_residual)
