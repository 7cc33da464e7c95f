"""The absorbed MLA layer's input kernel (agentrt_kernels.triton.latent_inputs) against its torch reference on
fresh random strided inputs; the reference is the MLA layer's own torch code, which the DeepSeek-V3 / GLM parity
tests check against transformers. Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.torch_ref.latent_inputs import latent_inputs as reference  # noqa: E402
from agentrt_kernels.triton.latent_inputs import latent_inputs  # noqa: E402
from engine.models.layers import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(tokens, heads, rank, rope, nope, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = randn(tokens, heads, nope + rope)  # the q projection: q_pe is a strided view of it
    q_latent = randn(heads, tokens, rank).transpose(0, 1)  # as the bmm leaves it
    kv = randn(tokens, rank + rope)
    weight = (1 + 0.1 * torch.randn(rank, generator=gen)).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    with torch.device("cpu"):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            rotary = RotaryEmbedding(rope, 10000.0, None, 64)
        finally:
            torch.set_default_dtype(default)
    return q, q_latent, kv, weight, positions, rotary.cos_cache.to(DEVICE), rotary.sin_cache.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleave", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rank", [32, 24])  # 24: a partial block of latent channels
def test_latent_inputs_equal_the_reference(dtype, interleave, rank):
    tokens, heads, rope, nope = 3, 5, 8, 12
    q, q_latent, kv, weight, positions, cos, sin = _inputs(tokens, heads, rank, rope, nope, dtype, rank)
    q_pe = q[..., nope:]
    want_query, want_row, want_pe = reference(q_latent, q_pe.clone(), kv, positions, cos, sin, weight, 1e-6,
                                              0.7, interleave)
    before = q.clone()
    query, row, pe = latent_inputs(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, 0.7, interleave)
    assert query.shape == (tokens, heads, rank + rope) and row.shape == (tokens, 1, rank + rope)
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2  # the interpreter truncates where torch rounds
    for got, want in ((query, want_query), (row, want_row), (pe, want_pe)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(q[..., nope:].float(), want_pe.float(), atol=tol, rtol=tol)  # rotated in place
    assert torch.equal(q[..., :nope], before[..., :nope])  # the nope part is untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
def test_rows_stored_at_their_slots_in_the_same_launch(cache_dtype):
    """With ``cache_rows`` and ``slots`` each token's row also lands at its slot, cast to the cache's dtype as the
    storage's ``write`` casts it; a slot < 0 (a graph's padding row) writes nothing; the outputs are unchanged."""
    tokens, heads, rank, rope, nope = 4, 3, 24, 8, 12
    q, q_latent, kv, weight, positions, cos, sin = _inputs(tokens, heads, rank, rope, nope, torch.float32, 5)
    args = (q_latent, kv, positions, cos, sin, weight, 1e-6, 0.7, True)
    want_query, want_row, _ = latent_inputs(q_latent, q.clone()[..., nope:], *args[1:])
    cache = torch.full((10, rank + rope), 3.0, dtype=cache_dtype, device=DEVICE)
    slots = torch.tensor([7, 2, -1, 5], device=DEVICE)
    query, row, _ = latent_inputs(q_latent, q.clone()[..., nope:], *args[1:], cache_rows=cache, slots=slots)
    assert torch.equal(query, want_query) and torch.equal(row, want_row)
    # the interpreter truncates where the GPU and torch round (one bf16 ulp)
    tol = 0.0 if DEVICE.type == "cuda" or cache_dtype == torch.float32 else 2**-7
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(cache[slot].float(), want_row[t, 0].to(cache_dtype).float(), atol=tol,
                                       rtol=tol)
    untouched = [i for i in range(10) if i not in (7, 2, 5)]
    assert torch.all(cache[untouched] == 3.0)
    with pytest.raises(ValueError, match="go together"):
        latent_inputs(q_latent, q.clone()[..., nope:], *args[1:], cache_rows=cache)
    with pytest.raises(ValueError, match="cache_rows"):
        latent_inputs(q_latent, q.clone()[..., nope:], *args[1:], cache_rows=cache[:, 1:], slots=slots)


def test_interleaved_rope_reads_pairs():
    """With pairs the kernel must rotate (x0, x2, ..) against (x1, x3, ..): fed a rope key whose halves-layout
    rotation differs, the two modes give different rows (a kernel that ignored the flag would not)."""
    q, q_latent, kv, weight, positions, cos, sin = _inputs(2, 2, 16, 8, 4, torch.float32, 7)
    positions.fill_(5)
    rows = [latent_inputs(q_latent, q.clone()[..., 4:], kv, positions, cos, sin, weight, 1e-6, 1.0, mode)[1]
            for mode in (False, True)]
    assert not torch.allclose(rows[0][..., 16:], rows[1][..., 16:])
    torch.testing.assert_close(rows[0][..., :16], rows[1][..., :16])  # the latent part does not depend on it


def test_shapes_and_dtypes_are_checked():
    q, q_latent, kv, weight, positions, cos, sin = _inputs(2, 2, 16, 8, 4, torch.float32, 3)
    with pytest.raises(ValueError, match="norm_weight"):
        latent_inputs(q_latent, q[..., 4:], kv, positions, cos, sin, weight[:8], 1e-6, 1.0, False)
    with pytest.raises(ValueError, match="do not match"):
        latent_inputs(q_latent, q[..., 4:], kv[:, :20], positions, cos, sin, weight, 1e-6, 1.0, False)
    with pytest.raises(ValueError, match="positions"):
        latent_inputs(q_latent, q[..., 4:], kv, positions[:1], cos, sin, weight, 1e-6, 1.0, False)
    with pytest.raises(ValueError, match="share a dtype"):
        latent_inputs(q_latent.double(), q[..., 4:], kv, positions, cos, sin, weight, 1e-6, 1.0, False)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])  # rope halves / rope pairs
def test_models_through_the_kernel_equal_transformers(arch, mla_dirs, monkeypatch):
    """The MLA layer with the kernel in place of its torch code (fp32; the CPU interpreter, or on a GPU the compiled
    kernel) still gives transformers' logits: the kernel is wired to the layer's own norm, rotary caches and
    scale."""
    from agentrt_kernels.torch_ref import latent_inputs as reference_module
    from engine.loader import load_model
    from tests.engine.test_models_vs_hf import DenseCausalRunner
    from tests.hf_reference import hf_model

    calls = []

    def kernel(*args):
        calls.append(args[0].shape)
        if DEVICE.type == "cpu":
            return latent_inputs(*args)
        # on a GPU the compiled kernel, its CPU inputs moved over and its outputs back
        outs = latent_inputs(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
        return tuple(x.cpu() for x in outs)

    monkeypatch.setattr(reference_module, "latent_inputs", kernel)
    model, _ = load_model(mla_dirs[arch], dtype=torch.float32)
    ids = torch.randint(5, 500, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(str(mla_dirs[arch]))(ids[None]).logits[0]
        ours = model.compute_logits(model(ids, torch.arange(24), DenseCausalRunner()))
    assert len(calls) == model.config.num_layers
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton.grouped_router import route_grouped_sigmoid_from_hidden
from agentrt_kernels.triton.latent_inputs import latent_inputs

rows = []
for heads, rank, rope, nope, q_lora, experts, hidden, groups, top_k in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    t = 8
    q = torch.zeros(t, heads, nope + rope, **bf)
    packed = torch.zeros(t, q_lora + rank + rope, **bf)
    cos = torch.zeros(4096, rope // 2, **bf)
    calls = {
        "latent_inputs": lambda: latent_inputs(torch.zeros(heads, t, rank, **bf).transpose(0, 1), q[..., nope:],
                                               packed[:, q_lora:], torch.zeros(t, dtype=torch.int64), cos, cos,
                                               torch.zeros(rank, **bf), 1e-6, 0.1, True),
        "latent_inputs+store": lambda: latent_inputs(
            torch.zeros(heads, t, rank, **bf).transpose(0, 1), q[..., nope:], packed[:, q_lora:],
            torch.zeros(t, dtype=torch.int64), cos, cos, torch.zeros(rank, **bf), 1e-6, 0.1, True,
            cache_rows=torch.zeros(64, rank + rope, **bf), slots=torch.zeros(t, dtype=torch.int64)),
        "router": lambda: route_grouped_sigmoid_from_hidden(torch.zeros(t, hidden, **bf), torch.zeros(experts, hidden),
                                                            torch.zeros(experts), top_k, groups, max(1, groups // 2),
                                                            True, 2.5, torch.bfloat16, experts),
        "router+norm": lambda: route_grouped_sigmoid_from_hidden(
            torch.zeros(t, hidden, **bf), torch.zeros(experts, hidden), torch.zeros(experts), top_k, groups,
            max(1, groups // 2), True, 2.5, torch.bfloat16, experts, norm=(torch.zeros(hidden, **bf), 1e-5),
            residual=torch.zeros(t, hidden, **bf)),
        "router+norm@32": lambda: route_grouped_sigmoid_from_hidden(  # a bs32 decode step's rows: one dot tile
            torch.zeros(32, hidden, **bf), torch.zeros(experts, hidden), torch.zeros(experts), top_k, groups,
            max(1, groups // 2), True, 2.5, torch.bfloat16, experts, norm=(torch.zeros(hidden, **bf), 1e-5),
            residual=torch.zeros(32, hidden, **bf)),
    }
    for name, call in calls.items():
        with captured_launches() as launches:
            call()
        for i, (fn, args, options) in enumerate(launches):  # the router's: partial logits, then the routing
            r = compile_sm90(fn, args, **options)
            rows.append(dict(kernel=f"{name}:{i}", experts=experts,
                             **{k: r[k] for k in ("registers", "spill_stores")}))
print(json.dumps(rows))
"""


def test_the_kernels_compile_for_sm90_without_spills():
    """The MLA input kernel (storing its rows or not) and the router with its gate product inside (and the norm
    before it), at GLM-4.7-Flash's decode-step shapes (20 heads, latent 512 + 64, q_lora 768; 64 experts over 2048)
    and DeepSeek-V3's (128 heads, q_lora 1536; 256 experts in 8 groups over 7168, a gate its decode steps route
    through the GEMM instead), as compiled for an H100 / H200 (Triton's bundled ptxas, no GPU needed)."""
    from tests.kernels.sm90_compile import compiled_rows

    rows = compiled_rows(_SM90_SCRIPT, [[20, 512, 64, 192, 768, 64, 2048, 1, 4],
                                        [128, 512, 64, 128, 1536, 256, 7168, 8, 8]])
    assert len(rows) == 16
    for r in rows:
        assert r["spill_stores"] == 0, r
