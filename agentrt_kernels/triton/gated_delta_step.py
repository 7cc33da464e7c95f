"""One decode token of a gated DeltaNet layer for B sequences, their states updated in place by slot.

A hybrid model's linear layers keep per request a conv state [C, K-1] and a recurrent state [Hv, Dk, Dv] in slot
buffers (``engine.storage.recurrent``). Gathering a batch's states, running the step and storing the new states back
moves each state three times more than the step needs and costs separate launches; these kernels read each
request's state from its slot and write the new one over it.

``causal_conv1d_update(x [B, C], weight [C, K], states [S, C, K-1], slots [B])``: out [B, C] = SiLU of the
depthwise conv over (state ++ x), fp32 accumulation; the state shifts by one (x appended). Grid (B, cdiv(C, BLOCK_C)).

``gated_delta_step(q, k [B, Hk, Dk], v [B, Hv, Dv], a, b [B, Hv], A_log, dt_bias [Hv], states [S, Hv, Dk, Dv],
slots [B], scale)``: the gates as the layer computes them (beta = sigmoid(b) rounded to b's dtype, g = -exp(A_log)
* softplus(a + dt_bias) in fp32), q and k L2-normed (eps 1e-6) and q scaled, then per value head h (key head
h // (Hv / Hk))::

    S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q

with the state in fp32 (stored back in the buffer's dtype). Grid (B, Hv, cdiv(Dv, BLOCK_V)): each program holds a
[Dk, BLOCK_V] tile of the state. The torch references are ``agentrt_kernels.torch_ref.gated_delta``'s
``causal_conv1d_update`` / ``gated_delta_step`` (gather, the reference step, scatter). All math is fp32, so the
interpreter runs bf16 inputs correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import next_pow2


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, s_ptr, slots_ptr, o_ptr, channels, stride_xb, stride_wc, stride_ss,
                        stride_sc, stride_ob, KERNEL: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_C: tl.constexpr, ACTIVATION: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_K)
    cmask = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_xb + cols, mask=cmask, other=0.0)
    state_ptrs = s_ptr + slot * stride_ss + cols[:, None] * stride_sc + taps[None, :]
    smask = cmask[:, None] & (taps[None, :] < KERNEL - 1)
    state = tl.load(state_ptrs, mask=smask, other=0.0)
    # the window state ++ x ([BLOCK_C, BLOCK_K]: taps 0 .. K-2 the state, tap K-1 the new input)
    window = tl.where(taps[None, :] == KERNEL - 1, x[:, None].to(state.dtype), state)
    w = tl.load(w_ptr + cols[:, None] * stride_wc + taps[None, :], mask=cmask[:, None] & (taps[None, :] < KERNEL),
                other=0.0)
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if ACTIVATION:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(o_ptr + row * stride_ob + cols, acc.to(o_ptr.dtype.element_ty), mask=cmask)
    # the new state: taps 1 .. K-1 of the window, moved down by one
    shifted = tl.load(state_ptrs + 1, mask=cmask[:, None] & (taps[None, :] < KERNEL - 2), other=0.0)
    shifted = tl.where(taps[None, :] == KERNEL - 2, x[:, None].to(shifted.dtype), shifted)
    tl.store(state_ptrs, shifted.to(s_ptr.dtype.element_ty), mask=smask)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                         activation: bool = True) -> torch.Tensor:
    """x [B, C] (last dim contiguous); weight [C, K]; states [S, C, K-1] (updated in place at ``slots`` [B])
    -> out [B, C] in x's dtype."""
    batch, channels = x.shape
    kernel = weight.shape[1]
    assert states.shape[1:] == (channels, kernel - 1) and states.stride(2) == 1 and weight.stride(1) == 1
    assert x.stride(1) == 1 and kernel >= 2
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    block_c = min(256, next_pow2(channels))
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, weight, states, slots, out, channels, x.stride(0), weight.stride(0), states.stride(0), states.stride(1),
        out.stride(0), KERNEL=kernel, BLOCK_K=next_pow2(kernel), BLOCK_C=block_c, ACTIVATION=activation,
        num_warps=4)
    return out


@triton.jit
def _delta_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, slots_ptr, o_ptr,
                       stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
                       stride_ss, stride_sh, stride_sk, stride_ob, stride_oh, scale, group,
                       DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kcols = tl.arange(0, BLOCK_K)
    kmask, vmask = kcols < DK, vcols < DV
    kh = head // group
    slot = tl.load(slots_ptr + row).to(tl.int64)

    q = tl.load(q_ptr + row * stride_qb + kh * stride_qh + kcols, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kb + kh * stride_kh + kcols, mask=kmask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + row * stride_vb + head * stride_vh + vcols, mask=vmask, other=0.0).to(tl.float32)

    b_raw = tl.load(b_ptr + row * stride_bb + head)
    beta = (1.0 / (1.0 + tl.exp(-b_raw.to(tl.float32)))).to(b_raw.dtype).to(tl.float32)  # the layer's sigmoid
    a = tl.load(a_ptr + row * stride_ab + head).to(tl.float32) + tl.load(dtb_ptr + head).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + head).to(tl.float32)) * softplus

    state_ptrs = s_ptr + slot * stride_ss + head * stride_sh + kcols[:, None] * stride_sk + vcols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(state_ptrs, mask=smask, other=0.0).to(tl.float32) * tl.exp(g)
    kv_mem = tl.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(state_ptrs, s.to(s_ptr.dtype.element_ty), mask=smask)
    tl.store(o_ptr + row * stride_ob + head * stride_oh + vcols, out.to(o_ptr.dtype.element_ty), mask=vmask)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q, k [B, Hk, Dk]; v [B, Hv, Dv]; a, b [B, Hv] (raw gate inputs); A_log, dt_bias [Hv]; states
    [S, Hv, Dk, Dv] (updated in place at ``slots`` [B]) -> out [B, Hv, Dv] in q's dtype. Inner dims contiguous."""
    batch, nk, dk = k.shape
    nv, dv = v.shape[1:]
    assert q.shape == k.shape and nv % nk == 0 and states.shape[1:] == (nv, dk, dv), (q.shape, v.shape, states.shape)
    assert q.stride(2) == k.stride(2) == v.stride(2) == states.stride(3) == 1 and a.stride(1) == b.stride(1) == 1
    out = torch.empty(batch, nv, dv, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_v = min(64, next_pow2(dv))
    _delta_step_kernel[(batch, nv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, states, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1),
        dk**-0.5 if scale is None else scale, nv // nk,
        DK=dk, DV=dv, BLOCK_K=next_pow2(dk), BLOCK_V=block_v, num_warps=4)
    return out
