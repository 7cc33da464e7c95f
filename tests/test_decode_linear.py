"""agentrt_kernels.triton.decode_linear (RMSNorm / SiLU-and-mul fused before a decode-size linear) vs the
unfused torch ops the engine runs (engine.models.layers: RMSNorm, silu_and_mul; F.linear), on fresh random
inputs.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported)
at small sizes. fp32: the product agrees to fp32 rounding; fp16 (and bf16 on a GPU): the residual sum is
bit-equal and the output agrees to what a different fp32 summation order and one rounding allow.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from agentrt_kernels.triton.decode_linear import decode_linear  # noqa: E402
from engine.models.layers import RMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(got, want, dtype):
    """The interpreter truncates fp32 -> bf16 instead of rounding: there bf16 is checked by its relative error
    norm (and compiled for sm_90a by benchmarks.sm90_launches); on a GPU element by element."""
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2  # two truncations
    else:
        torch.testing.assert_close(got, want, **TOL[dtype])


def _seed(*key) -> None:
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _torch_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[1], eps).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    return norm._norm(x) if residual is None else (norm._norm(x + residual), x + residual)


def _torch_silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,fma", [(1, 96, 160, False), (1, 96, 160, True), (5, 64, 384, False),
                                          (16, 40, 256, False)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_then_linear(dtype, rows, n, k, fma, residual, bias):
    _seed("norm", dtype, rows, n, k, residual, bias)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    res = torch.randn(rows, k, device=DEVICE).to(dtype) if residual else None
    norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    got = decode_linear(x, w, b, norm=(norm_w, 1e-6), residual=res, launch={"BLOCK_N": 32, "BLOCK_K": 64, "FMA": fma})
    if residual:
        normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
        got, got_res = got
        if dtype == torch.bfloat16 and DEVICE.type != "cuda":
            torch.testing.assert_close(got_res, want_res, rtol=8e-3, atol=8e-3)  # one bf16 ulp
        else:
            assert torch.equal(got_res, want_res)
        assert got_res.data_ptr() != res.data_ptr()
    else:
        normed = _torch_norm(x, norm_w, 1e-6)
    want = F.linear(normed.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_normed_rows_come_back_too(dtype):
    """``return_normed``: the operand every column read, as the torch norm computes it (a MoE block's experts
    read it after the router's product)."""
    _seed("normed", dtype)
    rows, n, k = 6, 20, 192  # N below one block: the one program writes every normed row
    x, res = (torch.randn(rows, k, device=DEVICE).to(dtype) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    got, got_res, got_normed = decode_linear(x, w, norm=(norm_w, 1e-6), residual=res, return_normed=True,
                                             launch={"BLOCK_N": 16, "BLOCK_K": 64})
    normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        torch.testing.assert_close(got_normed, normed, rtol=2e-2, atol=2e-2)  # two truncations, ~2 bf16 ulp
    elif dtype == torch.float32 and DEVICE.type == "cuda":  # another sum order and the GPU's rsqrt
        torch.testing.assert_close(got_normed, normed, rtol=1e-5, atol=1e-6)
        assert torch.equal(got_res, want_res)
    else:
        assert torch.equal(got_normed, normed) and torch.equal(got_res, want_res)
    assert_close(got, F.linear(normed.float(), w.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,fma", [(1, 64, 200, False), (1, 64, 200, True), (8, 48, 128, False)])
def test_silu_and_mul_then_linear(dtype, rows, n, k, fma):
    _seed("silu", dtype, rows, n, k)
    x = (2 * torch.randn(rows, 2 * k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    got = decode_linear(x, w, silu_mul=True, launch={"BLOCK_N": 16, "BLOCK_K": 64, "FMA": fma})
    want = F.linear(_torch_silu_mul(x).float(), w.float()).to(dtype)
    assert_close(got, want, dtype)


def test_plain_linear_and_the_default_launch():
    _seed("plain")
    x, w = torch.randn(3, 512, device=DEVICE), torch.randn(70, 512, device=DEVICE) / 20
    torch.testing.assert_close(decode_linear(x, w), F.linear(x, w), **TOL[torch.float32])


def test_bad_arguments_are_refused():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 rows"):
        decode_linear(torch.randn(17, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="exclusive"):
        decode_linear(x, w, norm=(torch.ones(8, device=DEVICE), 1e-6), silu_mul=True)
    with pytest.raises(ValueError, match="residual and return_normed need norm"):
        decode_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="residual and return_normed need norm"):
        decode_linear(x, w, return_normed=True)
    with pytest.raises(ValueError, match="does not match weight"):
        decode_linear(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="norm weight"):
        decode_linear(x, w, norm=(torch.ones(7, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="contiguous"):
        decode_linear(torch.randn(8, 2, device=DEVICE).t(), w)
