"""The one CPU/GPU switch for the kernels the models, the cache and the methods call.

Each op has one signature on both devices: on a CUDA tensor it runs the Triton kernel
(``agentrt_kernels.triton``), on any other the torch reference (``agentrt_kernels.torch_ref``), with the same
result up to the kernel's rounding (the kernel tests give the tolerances). ``uses_triton`` is the rule that
picks; tests that want a kernel on the CPU (the Triton interpreter, ``TRITON_INTERPRET=1``) monkeypatch it, or
pass ``use_triton`` where an op takes it.

Importing this module does not import triton (about a second on a CPU-only machine, and the interpreter must
be chosen before it): the kernels are imported by the first call that takes the Triton path.

The last section holds kernels with no torch reference here (their CPU counterpart is the caller's own torch
code): they run Triton on every device, the interpreter on a CPU, and the caller chooses with ``uses_triton``.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from agentrt_kernels.torch_ref import activation as _activation_ref
from agentrt_kernels.torch_ref import decode_logits as _decode_logits_ref
from agentrt_kernels.torch_ref import gated_delta as _gated_delta_ref
from agentrt_kernels.torch_ref import kv_store as _kv_store_ref
from agentrt_kernels.torch_ref import latent_inputs as _latent_inputs_ref
from agentrt_kernels.torch_ref import moe as _moe_ref
from agentrt_kernels.torch_ref import moe_router as _moe_router_ref
from agentrt_kernels.torch_ref import norm as _norm_ref
from agentrt_kernels.torch_ref import quest as _quest_ref
from agentrt_kernels.torch_ref import received_attention as _received_ref
from agentrt_kernels.torch_ref import rotary as _rotary_ref


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the ops run the Triton kernel on ``x``: a CUDA tensor."""
    return x.is_cuda


def _kernels(module: str | None = None) -> ModuleType:
    """``agentrt_kernels.triton`` (or its ``module``), imported on first use. Looked up at each call, so a test's
    monkeypatch of a kernel there is what runs."""
    name = "agentrt_kernels.triton" if module is None else f"agentrt_kernels.triton.{module}"
    return sys.modules.get(name) or importlib.import_module(name)


# --- model layers -----------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim -> out; with ``residual`` (the fused add + norm): (norm(x + residual),
    x + residual). ``zero_centered``: scale by ``1 + weight`` in fp32 before the cast (Qwen3-Next's norm)."""
    if uses_triton(x):
        return _kernels().rms_norm(x, weight, eps, residual, zero_centered=zero_centered)
    return _norm_ref.rms_norm(x, weight, eps, residual, zero_centered)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    if uses_triton(x):
        return _kernels().silu_and_mul(x)
    return _activation_ref.silu_and_mul(x)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the cos/sin rows at ``positions`` [T] -> (q, k); cos/sin rows of
    R/2 < D/2 values rotate the first R channels only (partial rotary). With ``q_norm_weight``/``k_norm_weight``
    [D], each head is RMS-normalized (``norm_eps``; Qwen3-Next's form with ``zero_centered``) first. Use the
    returned tensors: the kernel rotates q and k in place, the reference returns new ones."""
    norm = {"q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight, "norm_eps": norm_eps,
            "zero_centered": zero_centered}
    if uses_triton(q):
        return _kernels().apply_rotary(positions, q, k, cos_cache, sin_cache, **norm)
    return _rotary_ref.apply_rotary(positions, q, k, cos_cache, sin_cache, **norm)


def latent_inputs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: float,
    interleave: bool, cache_rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An absorbed MLA layer's attention inputs: q_latent [T, H, R], q_pe [T, H, P] (not yet rotated), kv
    [T, R + P] -> (query [T, H, R + P] = [q_latent, rope(q_pe)] * scale, latent row [T, 1, R + P] =
    [RMSNorm(latent), rope(k_pe)], rotated q_pe). Use the returned q_pe: the kernel rotates it in place. With
    ``cache_rows`` [S, R + P] and ``slots`` [T]: each row is also stored at ``cache_rows[slots[t]]`` (the kernel
    in the same launch, skipping slots < 0; the reference needs valid slots)."""
    args = (q_latent, q_pe, kv, positions, cos_cache, sin_cache, norm_weight, eps, scale, interleave)
    if uses_triton(kv):
        return _kernels("latent_inputs").latent_inputs(*args, cache_rows=cache_rows, slots=slots)
    out = _latent_inputs_ref.latent_inputs(*args)
    if cache_rows is not None:
        cache_rows[slots] = out[1][:, 0].to(cache_rows.dtype)
    return out


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head's rows times its own matrix: x [T, H, K] (last dim contiguous) and w [H, K, N] -> [T, H, N]
    contiguous (an absorbed MLA layer's query through W_UK, its output through W_UV). A decode step's rows (at
    most ``head_matmul.MAX_ROWS``) on a GPU take the kernel; other calls the batched GEMM over the heads."""
    if uses_triton(x) and x.stride(-1) == 1 and x.shape[0] <= (kernels := _kernels("head_matmul")).MAX_ROWS:
        return kernels.head_matmul(x, w)
    out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k[t], v[t] ([Hkv, D] each) to slot ``slot_mapping[t]`` of k_cache/v_cache [num_pages, page_size,
    Hkv, D]. The kernel skips slots < 0 (CUDA-graph padding); the reference needs valid slots."""
    if uses_triton(k_cache):
        return _kernels().store_kv(k, v, k_cache, v_cache, slot_mapping)
    return _kv_store_ref.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rotary_and_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    inplace_k: bool = False,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    zero_centered: bool = False,
) -> torch.Tensor:
    """``apply_rotary`` (q/k norms first, with the weights) and ``store_kv`` of the rotated k with v; returns the
    rotated q (the kernel rotates q in place, the reference returns a new one). k is left as it is unless
    ``inplace_k``."""
    kw = {"inplace_k": inplace_k, "q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight,
          "norm_eps": norm_eps, "zero_centered": zero_centered}
    if uses_triton(k_cache):
        return _kernels().rotary_and_store(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                                           **kw)
    return _rotary_ref.rotary_and_store(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                                        **kw)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in the logits' dtype),
    fp32 softmax, top-k, renormalized over the K when ``renormalize``. The kernel sends exact ties to the lower
    expert id."""
    if uses_triton(router_logits):
        return _kernels().route_topk(router_logits, top_k, renormalize)
    return _moe_router_ref.route_topk(router_logits, top_k, renormalize)


def route_grouped_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int,
                          topk_groups: int, renormalize: bool, scaling: float, out_dtype: torch.dtype,
                          shared_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 MoE routing: router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in
    ``out_dtype``). Sigmoid scores plus ``correction_bias`` pick ``topk_groups`` of ``groups`` expert groups
    (scored by their top two), then the top-k experts inside them; the weights are the uncorrected scores,
    renormalized when ``renormalize``, times ``scaling``. The kernel sends exact ties to the lower id.
    ``shared_expert``: a last column [T, K + 1] of that id with weight 1 (a shared expert among the routed)."""
    args = (router_logits, correction_bias, top_k, groups, topk_groups, renormalize, scaling, out_dtype,
            shared_expert)
    if uses_triton(router_logits):
        return _kernels().route_grouped_sigmoid(*args)
    return _moe_router_ref.route_grouped_sigmoid(*args)


def route_grouped_sigmoid_from_hidden(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
                                      top_k: int, groups: int, topk_groups: int, renormalize: bool, scaling: float,
                                      shared_expert: int | None = None, *,
                                      norm: tuple[torch.Tensor, float] | None = None,
                                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``route_grouped_sigmoid`` of the fp32 gate's logits ``x.float() @ gate_weight.T`` (x [T, H], gate_weight
    [E, H] fp32), weights in x's dtype. On a GPU, a few rows over a small gate (a decode step's) take two launches:
    the product split over hidden slices, then the routing; otherwise the gate GEMM, then
    ``route_grouped_sigmoid``. With ``norm`` = (weight, eps) and ``residual``: the rows are
    ``rms_norm(x, weight, eps, residual)``'s, computed in the product's launch where it has one; returns
    (topk_ids, topk_weights, normed, x + residual)."""
    args = (correction_bias, top_k, groups, topk_groups, renormalize, scaling, x.dtype, shared_expert)
    if (norm is None) != (residual is None):
        raise ValueError("norm and residual go together")
    if uses_triton(x):
        kernels = _kernels("grouped_router")
        if kernels.hidden_route_fits(x.shape[0], gate_weight.shape[0], x.shape[1]):
            return kernels.route_grouped_sigmoid_from_hidden(x, gate_weight, *args, norm=norm, residual=residual)
    if norm is None:
        return route_grouped_sigmoid(torch.nn.functional.linear(x.float(), gate_weight), *args)
    normed, residual = rms_norm(x, norm[0], norm[1], residual)
    return (*route_grouped_sigmoid(torch.nn.functional.linear(normed.float(), gate_weight), *args), normed, residual)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Top-k routed SwiGLU experts: x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I]; topk_weights [T, K] in
    x.dtype; topk_ids [T, K] int64 -> [T, H]. The kernel has no host sync (CUDA-graph capturable); the
    reference loops over the experts that received tokens."""
    if uses_triton(x):
        return _kernels().fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return _moe_ref.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_states: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (L2-normed q / k) over N sequences packed along the tokens, each from its own state:
    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; initial_states [N, Hv, Dk, Dv]; ``lens`` the N lengths
    (summing to T). Returns (out [T, Hv, Dv] in q.dtype, final states [N, Hv, Dk, Dv] fp32). On a GPU fla-core's
    chunked kernel takes all N in one launch; elsewhere the reference runs each sequence."""
    if _fla().available(q):
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64).to(q.device, non_blocking=True)
        return _fla().chunk_varlen(q, k, v, g, beta, initial_states, cu)
    out, finals, start = torch.empty_like(v), [], 0
    for i, n in enumerate(lens):
        end = start + n
        out[start:end], final = _gated_delta_ref.chunk_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], initial_states[i])
        finals.append(final)
        start = end
    return out, torch.stack(finals)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; states
    [B, Hv, Dk, Dv] -> (out [B, Hv, Dv] in q.dtype, new states fp32). fla-core's fused recurrent kernel on a
    GPU; elsewhere the reference with the B sequences' heads stacked into one token's (heads are independent)."""
    if _fla().available(q):
        return _fla().recurrent_step(q, k, v, g, beta, states)
    batch, nk, dk = k.shape
    nv, dv = v.shape[1:]
    out, new = _gated_delta_ref.recurrent_gated_delta_rule(
        q.reshape(1, batch * nk, dk), k.reshape(1, batch * nk, dk), v.reshape(1, batch * nv, dv),
        g.reshape(1, batch * nv), beta.reshape(1, batch * nv), states.reshape(batch * nv, dk, dv))
    return out.view(batch, nv, dv), new.view(batch, nv, dk, dv)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The DeltaNet's output norm: RMSNorm of x's last dim (scaled by ``weight``, not zero-centred) times
    SiLU(gate) in fp32, in x's dtype; x, gate [T, heads, D]."""
    if uses_triton(x):
        return _kernels("gated_norm").gated_rms_norm(x, gate, weight, eps)
    return _norm_ref.gated_rms_norm(x, gate, weight, eps)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         activation: bool = True) -> torch.Tensor:
    """One token of B sequences through the short causal conv, x [B, C] (SiLU when ``activation``), from the
    conv states at ``slots`` [B] of ``states`` [S, C, K-1], replaced in place by the new ones; returns [B, C]."""
    if uses_triton(x):
        return _kernels("gated_delta_step").causal_conv1d_update(x, weight, states, slots, activation)
    return _gated_delta_ref.causal_conv1d_update(x, weight, states, slots, activation)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """One decode token of B sequences through the gated delta rule with the layer's gates computed from its raw
    projections a, b [B, Hv] (``torch_ref.gated_delta.gated_delta_gates``), from the recurrent states at ``slots``
    [B] of ``states`` [S, Hv, Dk, Dv], replaced in place by the new ones; returns out [B, Hv, Dv] in q's dtype."""
    if uses_triton(q):
        return _kernels("gated_delta_step").gated_delta_step(q, k, v, a, b, A_log, dt_bias, states, slots)
    return _gated_delta_ref.gated_delta_step(q, k, v, a, b, A_log, dt_bias, states, slots)


def _fla() -> ModuleType:
    """``agentrt_kernels.fla_gated_delta``, imported on first use (as the Triton kernels are)."""
    name = "agentrt_kernels.fla_gated_delta"
    return sys.modules.get(name) or importlib.import_module(name)


# --- methods ----------------------------------------------------------------------------------------------


def paged_decode_logits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: torch.Tensor, kv_lens_cpu: list[int], scale: float, width: int) -> torch.Tensor:
    """[B, Hq, width] fp32 ``q . k * scale`` of one query per request over its paged context (-inf padding)."""
    if uses_triton(q):
        return _kernels().paged_decode_logits(q, k_cache, block_tables, kv_lens, scale, width)
    return _decode_logits_ref.paged_decode_logits(q, k_cache, block_tables, kv_lens_cpu, scale, width)


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                      aggregate: str = "max") -> torch.Tensor:
    """[S, W] fp32 Quest upper bounds of the pages ``pages[s]`` (ids into the layer's ``kmin``/``kmax``
    [num_pages, Hkv, D]) for the decode queries ``q`` [S, Hq, D], aggregated over query heads."""
    if uses_triton(q):
        return _kernels().quest_page_scores(q, kmin, kmax, pages, aggregate)
    idx = pages.long()
    return _quest_ref.quest_page_scores(q, kmin[idx], kmax[idx], aggregate)


def quest_decode_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int, aggregate: str = "max",
                        *, use_triton: bool | None = None) -> torch.Tensor:
    """A pure-decode step's Quest scores: the new key (slot ``kv_lens - 1``) widens its page's bounds in
    ``kmin``/``kmax`` in place, then [B, W] fp32 scores of every column of ``block_tables`` before the row's last
    page (the rest -inf). ``use_triton`` (default: ``uses_triton(q)``): the kernel, one launch."""
    if uses_triton(q) if use_triton is None else use_triton:
        return _kernels().quest_decode_scores(q, kmin, kmax, k_cache, block_tables, kv_lens, page_size, aggregate)
    return _quest_ref.quest_decode_scores(q, kmin, kmax, k_cache, block_tables, kv_lens, page_size, aggregate)


def quest_decode_table(top_values: torch.Tensor, top_indices: torch.Tensor, block_tables: torch.Tensor,
                       kv_lens: torch.Tensor, page_size: int, token_budget: int, max_kept: int,
                       *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """From the top-k page scores of ``quest_decode_scores``: the selected table [B, k + 1] (kept pages in
    column order, then the last page) and its lengths [B]. ``use_triton`` (default: ``uses_triton`` of the
    table): the kernel, one launch."""
    if uses_triton(block_tables) if use_triton is None else use_triton:
        return _kernels().quest_decode_table(top_values, top_indices, block_tables, kv_lens, page_size,
                                             token_budget, max_kept)
    return _quest_ref.quest_decode_table(top_values, top_indices, block_tables, kv_lens, page_size, token_budget,
                                         max_kept)


def window_votes(q: torch.Tensor, k_cache: torch.Tensor, pages: torch.Tensor, n: int, scale: float,
                 use_triton: bool | None = None) -> torch.Tensor:
    """[Hkv, n] fp32: the attention probabilities the ``w`` query rows ``q`` [w, Hq, D] put on a request's ``n``
    paged slots (``pages`` [num_pages] int32 ids), summed over the rows and each KV head's query heads. The
    rows are the request's last ``w`` slots, causal among themselves (row j sees slots < n - w + j + 1). On a
    GPU (``use_triton``, default: ``uses_triton(q)``): the key-split log-sum-exp and the received-attention
    kernels, no [w, n] probability matrix."""
    return window_votes_with(window_vote_inputs(pages, n, q.shape[0], q.device), q, k_cache, scale, use_triton)[0]


@dataclass(slots=True)
class WindowVoteInputs:
    """What ``window_votes_with`` reads besides the queries and the keys: ``w`` rows over ``n`` slots, for one
    request's layer or (``block_tables`` of several rows) as many layers' slots as rows."""

    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    n: int
    w: int

    @property
    def layers(self) -> int:
        return self.block_tables.shape[0]


def window_vote_inputs(pages: torch.Tensor, n: int, w: int, device: torch.device,
                       page_offsets: list[int] | None = None) -> WindowVoteInputs:
    """``WindowVoteInputs`` for ``w`` rows over ``n`` slots of ``pages``: built once for every layer of a request
    that holds as many slots in each (a SnapKV vote), without a host sync (a blocking copy to the device would
    wait for the GPU's queue). ``page_offsets``: several layers at once, the keys read from one tensor holding
    every layer's pages (``KVStorage.all_layer_keys``), layer i's pages at ``pages + page_offsets[i]``."""
    block_tables = pages[None].to(device=device, dtype=torch.int32, non_blocking=True)
    if page_offsets is not None:
        offsets = torch.tensor(page_offsets, dtype=torch.int32).to(device, non_blocking=True)
        block_tables = block_tables + offsets[:, None]
    layers = block_tables.shape[0]
    kv_lens = torch.full((layers,), n, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (layers + 1) * w, w, dtype=torch.int32).to(device, non_blocking=True)
    return WindowVoteInputs(block_tables, kv_lens, qsl, n, w)


def window_votes_with(inputs: WindowVoteInputs, q: torch.Tensor, k_cache: torch.Tensor, scale: float,
                      use_triton: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``window_votes`` from ``window_vote_inputs`` of L layers (one or more): [L, Hkv, n] fp32 from their window
    rows ``q`` [L * w, Hq, D] (layer by layer), written into ``out`` of that shape if given. On a GPU three
    launches however many layers (the key tiles' partial log-sum-exp, their merge, the received attention), the
    result straight into ``out``."""
    i = inputs
    if uses_triton(q) if use_triton is None else use_triton:
        kernels = _kernels("received_attention")
        lse = kernels.paged_lse(q, k_cache, i.block_tables, i.kv_lens, i.query_start_loc, scale, i.n, i.w)
        return kernels.received_attention(q, k_cache, i.block_tables, i.kv_lens, i.query_start_loc, lse, scale,
                                          i.n, i.w, out=out)
    votes = torch.stack(_received_ref.received_attention(q, k_cache, i.block_tables, [i.n] * i.layers,
                                                         [i.w] * i.layers, scale))
    return votes if out is None else out.copy_(votes)


# --- Triton only: the caller's torch code is the CPU path -------------------------------------------------


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                  silu_mul: bool = False, return_normed: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A few rows' projection with its RMSNorm (and residual add) or SiLU-and-mul prologue fused in
    (``agentrt_kernels.triton.decode_linear``); the unfused layers are the reference."""
    return _kernels("decode_linear").decode_linear(x, weight, bias, norm=norm, residual=residual,
                                                   silu_mul=silu_mul, return_normed=return_normed)


def cluster_decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, members: torch.Tensor, offsets: torch.Tensor,
                            selected: torch.Tensor, recent_start: int, kv_len: int,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RetroInfer's exact part read in place: per-split (outputs, log-sum-exps) over the selected clusters'
    member slots and the recent range (``agentrt_kernels.triton.cluster_decode``)."""
    return _kernels("cluster_decode").cluster_decode_partials(q, k_cache, v_cache, block_table, members, offsets,
                                                              selected, recent_start, kv_len, scale)


def asym_encode_supported(head_dim: int, bits: int, group: int) -> bool:
    """Whether the asymmetric-quantization encode kernels take this shape (``agentrt_kernels.triton.asym_encode``)."""
    return _kernels("asym_encode").supported(head_dim, bits, group)


def asym_encode_channel_groups(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                               zero: torch.Tensor, bits: int, group: int) -> None:
    """Encode and store keys with per-channel statistics over groups of ``group`` tokens (KIVI's keys)."""
    _kernels("asym_encode").encode_channel_groups(x, slots, codes, scale, zero, bits, group)


def asym_encode_token_groups(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                             zero: torch.Tensor, bits: int, group: int) -> None:
    """Encode and store values with per-token statistics over groups of ``group`` channels (KIVI's values)."""
    _kernels("asym_encode").encode_token_groups(x, slots, codes, scale, zero, bits, group)
