"""Paged decode attention logits: the scaled scores ``q . k * scale`` of one query per request over its
whole paged context, for methods that rank slots by attention (H2O, TOVA, OmniKV's observation layers).

``paged_decode_logits(q, k_cache, block_tables, kv_lens, scale, width)``
    q:            [B, Hq, D] fp32 / fp16 / bf16 (last dim contiguous)
    k_cache:      [num_pages, page_size, Hkv, D], same dtype as q; Hq % Hkv == 0
    block_tables: [B, max_pages] int32; kv_lens: [B] int32
    width:        columns of the output (>= max(kv_lens), a host int)
    returns       [B, Hq, width] fp32 logits; columns >= kv_lens[b] hold -inf

Grid (B, Hkv, cdiv(width, BLOCK_N)): one program scores BLOCK_N tokens for every query head of one KV head
group, so each key tile is read once per group (the same gather through the page table as the decode
kernel). A softmax over the last dim gives the attention probabilities; the output is 4 bytes per query
head and token, small next to the K/V bytes a decode step reads anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import cdiv, check_last_dim_contiguous, dot_args, head_tile, next_pow2


@triton.jit
def _decode_logits_kernel(
    q_ptr, k_ptr, bt_ptr, lens_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_btb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    n_mask = tok < kv_len

    dot_ty = tl.float32 if UPCAST else k_ptr.dtype.element_ty
    q_at = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = (tok % PAGE_SIZE).to(tl.int64)
    k_at = k_ptr + kvh.to(tl.int64) * stride_kh + (page * stride_kp + in_page * stride_ks)[:, None]
    s = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for c in range(NUM_D):  # one slice unless the head is wider than 256 channels (a 576-channel latent)
        offs_c = c * BLOCK_D + offs_d
        c_mask = offs_c < HEAD_DIM
        q = tl.load(q_at + offs_c[None, :], mask=g_mask[:, None] & c_mask[None, :], other=0.0).to(dot_ty)
        k = tl.load(k_at + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        s += tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=PRECISION)
    s = s * scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    out = out_ptr + b.to(tl.int64) * stride_ob + head[:, None].to(tl.int64) * stride_oh + tok[None, :]
    tl.store(out, s, mask=g_mask[:, None])


def paged_decode_logits(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
    width: int, block_n: int = 64,
) -> torch.Tensor:
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("kv_lens", kv_lens)
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    tiles = max(cdiv(width, block_n), 1)
    out = torch.empty(batch, num_q_heads, tiles * block_n, dtype=torch.float32, device=q.device)
    if batch:
        upcast, precision = dot_args(_decode_logits_kernel, q.dtype)
        block_d = head_tile(head_dim)
        _decode_logits_kernel[(batch, num_kv_heads, tiles)](
            q, k_cache, block_tables, kv_lens, out, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=max(16, next_pow2(group)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_D=cdiv(head_dim, block_d),
            PAGE_SIZE=page_size, BLOCK_N=block_n, UPCAST=upcast, PRECISION=precision,
        )
    return out[:, :, :width]
