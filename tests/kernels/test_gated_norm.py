"""The DeltaNet's gated RMSNorm kernel (agentrt_kernels.triton.gated_norm) against its torch reference, itself
checked bit for bit against transformers' Qwen3NextRMSNormGated, on fresh random strided inputs. Without a GPU
the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.torch_ref.norm import gated_rms_norm as reference  # noqa: E402
from agentrt_kernels.triton.gated_norm import gated_rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [32, 24])  # 24: a partial block of columns
def test_gated_rms_norm_equals_the_reference(dtype, d):
    gen = torch.Generator().manual_seed(d)
    tokens, heads = 5, 3
    x = torch.randn(tokens, heads, d, generator=gen).to(DEVICE, dtype)
    packed = torch.randn(tokens, 2 * heads * d, generator=gen).to(DEVICE, dtype)  # the gate as a strided split
    gate = packed[:, heads * d:].view(tokens, heads, d)
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    got = gated_rms_norm(x, gate, weight, 1e-6)
    want = reference(x, gate, weight, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the interpreter truncates where torch rounds
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_reference_is_transformers_gated_norm(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gen = torch.Generator().manual_seed(1)
    x, gate = torch.randn(4, 2, 16, generator=gen).to(dtype), torch.randn(4, 2, 16, generator=gen).to(dtype)
    hf = Qwen3NextRMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + torch.randn(16, generator=gen))
        assert torch.equal(reference(x, gate, hf.weight, 1e-6), hf(x, gate))
