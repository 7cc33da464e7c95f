"""The per-head product kernel (agentrt_kernels.triton.head_matmul) against torch.bmm over the heads, on fresh
random inputs laid out as the absorbed MLA layer hands them over: W_UK and W_UV as views of the packed kv_b
weight (W_UV transposed), the query's nope part a strided view of the q projection. Without a GPU the kernel runs
in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels import ops  # noqa: E402
from agentrt_kernels.triton.head_matmul import MAX_ROWS, head_matmul  # noqa: E402
from tests.kernels.sm90_compile import compiled_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _bmm(x, w):
    return torch.bmm(x.float().transpose(0, 1), w.float()).transpose(0, 1)


def _absorbed_layer(tokens, heads, nope, rope, rank, v, dtype, seed):
    """(q_nope view [T, H, nope], W_UK view [H, nope, rank], W_UV^T view [H, rank, v], attention out [T, H, rank])."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = randn(tokens, heads, nope + rope)
    kv_b = (randn(heads * (nope + v), rank) / rank**0.5).view(heads, nope + v, rank)
    return q[..., :nope], kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2), randn(tokens, heads, rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16, 23, MAX_ROWS])
def test_both_absorbed_products_equal_the_batched_gemm(dtype, tokens):
    """The query through W_UK (K = 48 nope channels: a partial K block; N = 80 latent channels: a partial
    column block) and the output through W_UV^T (K = 80, N = 40), each as torch.bmm over the heads."""
    q_nope, w_uk, w_uv_t, attn = _absorbed_layer(tokens, 3, 48, 16, 80, 40, dtype, seed=tokens)
    for x, w in ((q_nope, w_uk), (attn, w_uv_t)):
        got = head_matmul(x, w)
        assert got.shape == (tokens, 3, w.shape[2]) and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.float(), _bmm(x, w), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_launch_tiles_change_nothing_but_the_rounding_order():
    q_nope, w_uk, _, _ = _absorbed_layer(4, 2, 48, 16, 80, 40, torch.float32, seed=7)
    want = _bmm(q_nope, w_uk)
    for block_n, block_k in ((16, 16), (32, 128), (128, 32)):
        torch.testing.assert_close(head_matmul(q_nope, w_uk, block_n=block_n, block_k=block_k), want,
                                   atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused():
    x, w = torch.zeros(2, 3, 8, device=DEVICE), torch.zeros(3, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        head_matmul(x, w[:2])
    with pytest.raises(ValueError, match="dtype"):
        head_matmul(x, w.half())
    with pytest.raises(ValueError, match="rows"):
        head_matmul(torch.zeros(MAX_ROWS + 1, 3, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        head_matmul(torch.zeros(2, 3, 16, device=DEVICE)[..., ::2], w)


def test_ops_takes_the_kernel_for_decode_rows_and_the_batched_gemm_otherwise(monkeypatch):
    """``ops.head_matmul``: on the CPU torch.bmm (what the MLA layer ran before, bit for bit); on the kernel
    path the kernel for at most MAX_ROWS rows, the batched GEMM for more."""
    from agentrt_kernels.triton import head_matmul as module

    q_nope, w_uk, _, _ = _absorbed_layer(MAX_ROWS + 1, 2, 48, 16, 80, 40, torch.float32, seed=3)
    cpu = ops.head_matmul(q_nope.cpu(), w_uk.cpu())
    assert torch.equal(cpu, torch.bmm(q_nope.cpu().transpose(0, 1), w_uk.cpu()).transpose(0, 1))
    calls = []
    monkeypatch.setattr(module, "head_matmul", lambda *a, _o=module.head_matmul: calls.append(1) or _o(*a))
    monkeypatch.setattr(ops, "uses_triton", lambda t: True)
    ops.head_matmul(q_nope[:MAX_ROWS], w_uk)
    ops.head_matmul(q_nope, w_uk)
    assert calls == [1]


_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import head_matmul as module
from agentrt_kernels.triton.head_matmul import head_matmul

module.pdl = lambda device: True  # launched as on a Hopper GPU: programmatic dependent launch
rows = []
for heads, nope, rank, v in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    kv_b = torch.zeros(heads, nope + v, rank, **bf)
    for name, x, w in (("w_uk", torch.zeros(8, heads, nope + 64, **bf)[..., :nope], kv_b[:, :nope]),
                       ("w_uv", torch.zeros(8, heads, rank, **bf), kv_b[:, nope:].transpose(1, 2))):
        with captured_launches() as launches:
            head_matmul(x, w)
        for fn, args, options in launches:
            r = compile_sm90(fn, args, **options)
            rows.append(dict(kernel=name, **{k: r[k] for k in ("registers", "spill_stores", "launch_order")}))
print(json.dumps(rows))
"""


def test_the_kernel_compiles_for_sm90_without_spills():
    """At GLM-4.7-Flash's heads (20; nope 192, latent 512, v 256), as compiled and launched for an H100 / H200:
    no spills; the wait for the previous kernel, then the next one let in."""
    rows = compiled_rows(_SM90_SCRIPT, [[20, 192, 512, 256]])
    assert [r["kernel"] for r in rows] == ["w_uk", "w_uv"]
    for r in rows:
        assert r["spill_stores"] == 0 and r["launch_order"] == ["wait", "launch_dependents"], r


def test_the_launch_sweep_runs_and_every_launch_computes_the_product():
    """``benchmarks.head_matmul --tiny``: both products at each row count, every launch within rounding of bmm."""
    from benchmarks.head_matmul import TINY_SPACE, main

    rows = main(["--tiny", "--rows", "1,3"])
    assert [(r["case"], r["rows"]) for r in rows] == [("w_uk", 1), ("w_uv", 1), ("w_uk", 3), ("w_uv", 3)]
    for r in rows:
        assert len(r["launches"]) == len(TINY_SPACE["block_n"]) and r["max_rel_err"] < 1e-5, r
