"""Reference gated DeltaNet ops (Qwen3-Next / Qwen3.5 linear attention) for one sequence: the short causal
depthwise convolution with its state, and the gated delta rule in its chunked and token-by-token forms.

Written after transformers' torch fallbacks in ``modeling_qwen3_next.py`` (``causal_conv1d_fn`` /
``causal_conv1d_update``, ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``), with the
batch dim dropped and the state made explicit so a sequence can be continued across steps: every function
takes the state before its tokens and returns the state after them. Layouts: tokens first (``[L, H, D]``).

The gated delta rule, per value head h with its key/query head ``h // (Hv / Hk)`` and fp32 state
``S [Dk, Dv]``, for each token t::

    S = exp(g_t) * S
    S = S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write the part of v_t that S does not predict)
    o_t = S^T q_t

with q and k L2-normalized (``use_qk_l2norm``) and q scaled by ``Dk ** -0.5``. The chunked form computes the same
with a few matmuls per chunk of ``chunk_size`` tokens (the UT transform of the DeltaNet paper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as transformers' (and FLA's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, activation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence continuing from its state.

    x [L, C]; weight [C, K]; state [C, K-1]: the last K-1 inputs before x (None: zeros, a sequence's start).
    Returns (out [L, C] in x.dtype, SiLU applied when ``activation``; new state [C, K-1]: the last K-1 inputs
    of ``state ++ x``, in x.dtype). The conv runs in the weight's dtype, as transformers' ``causal_conv1d_fn``.
    """
    length, channels = x.shape
    kernel = weight.shape[1]
    if state is None:
        state = x.new_zeros(channels, kernel - 1)
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1 + L]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]  # [C, L]
    if activation:
        out = F.silu(out)
    new_state = window[:, window.shape[1] - (kernel - 1):].clone()
    return out.t().to(x.dtype), new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences (decode): x [B, C]; weight [C, K]; state [B, C, K-1] -> (out [B, C],
    new state [B, C, K-1]); each row equals ``causal_conv1d`` of that sequence alone."""
    batch, channels = x.shape
    kernel = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = F.conv1d(window.reshape(1, batch * channels, kernel).to(weight.dtype),
                   weight[:, None, :].repeat(batch, 1, 1), groups=batch * channels).view(batch, channels)
    if activation:
        out = F.silu(out)
    return out.to(x.dtype), window[:, :, 1:].clone()


def _prepare(q, k, v, beta, g, use_qk_l2norm: bool):
    """[L, H, D] inputs -> fp32 [H, L, D] with q/k repeated to the value heads and L2-normed."""
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_k_heads != num_v_heads:  # each key/query head serves Hv / Hk consecutive value heads
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v, beta, g = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, beta, g


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk (transformers' ``torch_chunk_gated_delta_rule``).

    q, k [L, Hk, Dk]; v [L, Hv, Dv]; g [L, Hv] (log decay, <= 0); beta [L, Hv]; initial_state [Hv, Dk, Dv]
    (None: zeros). Returns (out [L, Hv, Dv] in q.dtype, final state [Hv, Dk, Dv] float32). fp32 math.
    """
    out_dtype, length = q.dtype, q.shape[0]
    num_v_heads, v_dim, k_dim = v.shape[1], v.shape[2], k.shape[2]
    q, k, v, beta, g = _prepare(q, k, v, beta, g, use_qk_l2norm)
    q = q * k_dim**-0.5

    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (length + pad) // chunk_size

    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(num_v_heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(num_v_heads, num_chunks, chunk_size)
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)

    cum = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    # decay[i, j] = exp(cum_i - cum_j) between positions j <= i of a chunk (0 above the diagonal)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum.exp()[..., None]
    # (I + strictly-lower(ut_system))^-1 applied to v_beta and to the decayed k_beta (unit diagonal assumed)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(device=q.device, dtype=torch.float32)
    out = torch.zeros_like(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, chunks, 1, 1]
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_v_heads, -1, v_dim)[:, :length]
    return out.transpose(0, 1).to(out_dtype).contiguous(), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (transformers' ``torch_recurrent_gated_delta_rule``); same arguments
    and results as ``chunk_gated_delta_rule``. Heads are independent, so B one-token sequences run as one call
    with their heads stacked (q [1, B*Hk, Dk], v [1, B*Hv, Dv], state [B*Hv, Dk, Dv])."""
    out_dtype, length = q.dtype, q.shape[0]
    num_v_heads, v_dim, k_dim = v.shape[1], v.shape[2], k.shape[2]
    q, k, v, beta, g = _prepare(q, k, v, beta, g, use_qk_l2norm)
    q = q / (k_dim**0.5)
    if initial_state is None:
        state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(device=q.device, dtype=torch.float32)
    out = torch.zeros_like(v)
    for t in range(length):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1).to(out_dtype).contiguous(), state


# --- one decode token of B sequences, states in slot buffers (the in-place kernels' references) ------------------


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's gates from its raw projections a, b [..., Hv]: (g = -exp(A_log) * softplus(a + dt_bias) in
    fp32, beta = sigmoid(b) in b's dtype), as transformers computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         activation: bool = True) -> torch.Tensor:
    """``causal_conv1d_step`` of x [B, C] from the states at ``slots`` [B] of ``states`` [S, C, K-1], which are
    replaced by the new ones; returns out [B, C]."""
    out, new = causal_conv1d_step(x, weight, states[slots], activation)
    states[slots] = new.to(states.dtype)
    return out


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """One token of B sequences (q, k [B, Hk, Dk]; v [B, Hv, Dv]) with the gates from a, b [B, Hv]
    (``gated_delta_gates``), from the states at ``slots`` of ``states`` [S, Hv, Dk, Dv], which are replaced by
    the new ones; returns out [B, Hv, Dv] in q's dtype."""
    batch, nk, dk = k.shape
    nv, dv = v.shape[1:]
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    out, new = recurrent_gated_delta_rule(
        q.reshape(1, batch * nk, dk), k.reshape(1, batch * nk, dk), v.reshape(1, batch * nv, dv),
        g.reshape(1, batch * nv), beta.reshape(1, batch * nv), states[slots].reshape(batch * nv, dk, dv))
    states[slots] = new.view(batch, nv, dk, dv).to(states.dtype)
    return out.view(batch, nv, dv)
