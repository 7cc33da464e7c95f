"""Asymmetric integer quantisation with bit-plane packing, encoded and stored in one launch.

The format the ``intn`` decode kernels read (``quant_decode.py``): ``bits``-bit codes ``c`` of
``x ~ c * scale + zero`` with fp16 ``scale`` / ``zero``, packed as ``8 // bits`` planes (plane ``p`` holds
channels ``[p W, (p + 1) W)``, ``W = D * bits / 8``, at bit offset ``p * bits`` of byte ``c``). The torch
definition is ``policies/kivi.py`` (``asym_params``, ``asym_quantize``, ``pack_planes``); this computes the
same values bit for bit: ``zero`` is the statistic's minimum rounded to fp16 and stepped one ulp down when that
rounded above it, ``scale = fp16((max - zero) / levels)`` stepped one ulp up when ``scale * levels + zero``
falls short of the maximum, codes ``clamp(round_half_even((x - zero) / scale), 0, levels)``. Launched without
FMA contraction so ``scale * levels + zero`` rounds twice, and dividing with ``div_rn`` (Triton's ``/`` on fp32
compiles to the approximate ``div.full.f32``), as in torch.

``encode_channel_groups(x, slots, codes, scale, zero, bits, group)``
    keys: statistics per channel over each run of G = ``group`` consecutive tokens (KIVI's per-channel keys).
    x [N, H, D] (N a multiple of G; run ``j`` is rows ``[j G, (j + 1) G)``), slots [N] int64 physical slots;
    codes [num_slots, H, W] uint8 written at ``slots``; scale / zero [num_slots // G, H, D] fp16 written at
    ``slots[j G] // G``.
``encode_token_groups(x, slots, codes, scale, zero, bits, group)``
    values: statistics per token over each run of ``group`` consecutive channels (KIVI's per-token values).
    codes [num_slots, H, W] uint8 and scale / zero [num_slots, H, D // group] fp16, all written at ``slots``.

Grids: (N // G, H) and (cdiv(N, BLOCK_T), H); every program loads its [rows, D] tile once, in fp32.
``supported(head_dim, bits, group)`` says which shapes they take (powers of two); the codecs encode others
with the torch definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous


@triton.jit
def _half_step(x, UP: tl.constexpr):
    """The next fp16 value above (UP) or below x, through the bit pattern (zero steps to +-the least subnormal)."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32)
    positive = bits >= 0
    if UP:
        stepped = tl.where(positive, bits + 1, bits - 1)
        stepped = tl.where(x == 0, 1, stepped)
    else:
        stepped = tl.where(positive, bits - 1, bits + 1)
        stepped = tl.where(x == 0, -32767, stepped)
    return stepped.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _asym_params(lo, hi, LEVELS: tl.constexpr):
    zero = lo.to(tl.float16)
    zero = tl.where(zero.to(tl.float32) > lo, _half_step(zero, False), zero)
    scale = tl.math.div_rn(hi - zero.to(tl.float32), LEVELS * 1.0).to(tl.float16)  # IEEE, as torch divides
    short = scale.to(tl.float32) * LEVELS + zero.to(tl.float32) < hi
    scale = tl.where(short, _half_step(scale, True), scale)
    return scale, zero


@triton.jit
def _quantize(x, scale, zero, LEVELS: tl.constexpr):
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0))  # ``/`` compiles to div.full (~2 ulp)
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1 where f is odd: a tie rounds to the even neighbour
    r = tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))
    return tl.minimum(tl.maximum(r, 0.0), LEVELS).to(tl.int32)


@triton.jit
def _store_packed(codes, rows, codes_ptr, stride_cn, stride_ch, h, ROWS: tl.constexpr, row_mask,
                  BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """codes [ROWS, HEAD_DIM] int32 -> bytes [ROWS, W] (plane p at bit p * BITS) stored at codes[rows, h]."""
    PLANES: tl.constexpr = 8 // BITS
    W: tl.constexpr = HEAD_DIM // PLANES
    planes = tl.reshape(codes, (ROWS, PLANES, W))
    shift = tl.arange(0, PLANES) * BITS
    packed = tl.sum(planes << shift[None, :, None], axis=1)
    offs_w = tl.arange(0, W)
    tl.store(codes_ptr + rows[:, None] * stride_cn + h * stride_ch + offs_w[None, :], packed.to(tl.uint8),
             mask=row_mask[:, None])


@triton.jit
def _channel_groups_kernel(
    x_ptr, slots_ptr, codes_ptr, scale_ptr, zero_ptr,
    stride_xn, stride_xh, stride_cn, stride_ch, stride_sn, stride_sh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
):
    j = tl.program_id(0)
    h = tl.program_id(1)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs_t = tl.arange(0, GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = j * GROUP + offs_t
    x = tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_xn + h * stride_xh + offs_d[None, :]).to(tl.float32)
    scale, zero = _asym_params(tl.min(x, 0), tl.max(x, 0), LEVELS)
    codes = _quantize(x, scale[None, :], zero[None, :], LEVELS)
    rows = tl.load(slots_ptr + tok)
    _store_packed(codes, rows, codes_ptr, stride_cn, stride_ch, h, GROUP, offs_t < GROUP, BITS, HEAD_DIM)
    group_row = tl.load(slots_ptr + j * GROUP) // GROUP
    at = group_row * stride_sn + h * stride_sh + offs_d
    tl.store(scale_ptr + at, scale)
    tl.store(zero_ptr + at, zero)


@triton.jit
def _token_groups_kernel(
    x_ptr, slots_ptr, codes_ptr, scale_ptr, zero_ptr, num_tokens,
    stride_xn, stride_xh, stride_cn, stride_ch, stride_sn, stride_sh,
    CHANNEL_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    NUM_GROUPS: tl.constexpr = HEAD_DIM // CHANNEL_GROUP
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * stride_xn + h * stride_xh + offs_d[None, :],
                mask=t_mask[:, None], other=0.0).to(tl.float32)
    groups = tl.reshape(x, (BLOCK_T, NUM_GROUPS, CHANNEL_GROUP))
    scale, zero = _asym_params(tl.min(groups, 2), tl.max(groups, 2), LEVELS)  # [BLOCK_T, NUM_GROUPS]
    codes = tl.reshape(_quantize(groups, scale[:, :, None], zero[:, :, None], LEVELS), (BLOCK_T, HEAD_DIM))
    rows = tl.load(slots_ptr + offs_t, mask=t_mask, other=0)
    _store_packed(codes, rows, codes_ptr, stride_cn, stride_ch, h, BLOCK_T, t_mask, BITS, HEAD_DIM)
    offs_g = tl.arange(0, NUM_GROUPS)
    at = rows[:, None] * stride_sn + h * stride_sh + offs_g[None, :]
    tl.store(scale_ptr + at, scale, mask=t_mask[:, None])
    tl.store(zero_ptr + at, zero, mask=t_mask[:, None])


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(head_dim: int, bits: int, group: int) -> bool:
    """Whether these kernels encode this shape: power-of-two head_dim and group, bits 2 / 4 / 8."""
    return bits in (2, 4, 8) and _pow2(head_dim) and _pow2(group) and group <= 128


def _check(x, slots, codes, scale, zero, bits, group, over: str):
    """Shapes, dtypes and contiguity of an encode call; ``group`` a power of two dividing x's ``over`` dim
    ("rows": token groups of per-channel statistics, "head_dim": channel groups of per-token ones)."""
    for name, t in (("x", x), ("codes", codes), ("scale", scale), ("zero", zero)):
        check_last_dim_contiguous(name, t)
    n, heads, head_dim = x.shape
    if bits not in (2, 4, 8) or not _pow2(head_dim):
        raise ValueError(f"bits must be 2, 4 or 8 and head_dim a power of two, got {bits}, {head_dim}")
    if slots.shape != (n,) or codes.shape[1:] != (heads, head_dim * bits // 8):
        raise ValueError(f"slots {tuple(slots.shape)} / codes {tuple(codes.shape)} do not fit x {tuple(x.shape)}")
    if scale.dtype != torch.float16 or zero.dtype != torch.float16 or codes.dtype != torch.uint8:
        raise ValueError("codes must be uint8 and scale / zero float16")
    size, what = (n, f"the {n} rows") if over == "rows" else (head_dim, f"head_dim {head_dim}")
    if not _pow2(group) or size % group:
        raise ValueError(f"group must be a power of two dividing {what}, got {group}")


def _row_head_strides(x, codes, scale) -> tuple[int, ...]:
    """(row, head) strides of x, the codes and the scale / zero fields (scale and zero share a layout)."""
    return x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1)


def encode_channel_groups(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor, bits: int, group: int) -> None:
    _check(x, slots, codes, scale, zero, bits, group, "rows")
    n, heads, head_dim = x.shape
    if n == 0:
        return
    _channel_groups_kernel[(n // group, heads)](
        x, slots, codes, scale, zero, *_row_head_strides(x, codes, scale),
        GROUP=group, HEAD_DIM=head_dim, BITS=bits, enable_fp_fusion=False,
    )


def encode_token_groups(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                        zero: torch.Tensor, bits: int, group: int, block_t: int = 16) -> None:
    _check(x, slots, codes, scale, zero, bits, group, "head_dim")
    n, heads, head_dim = x.shape
    if n == 0:
        return
    _token_groups_kernel[(triton.cdiv(n, block_t), heads)](
        x, slots, codes, scale, zero, n, *_row_head_strides(x, codes, scale),
        CHANNEL_GROUP=group, HEAD_DIM=head_dim, BITS=bits, BLOCK_T=block_t, enable_fp_fusion=False,
    )
