"""The fused quantized decode kernels (Triton) against the torch reference over the same quantized pages.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), at tiny sizes, fp32/fp16.
The reference (``agentrt_kernels.torch_ref.quantized_attention``) decodes pages through the codecs' own decode; it is
itself checked against dense attention over the decoded KV here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.contract.codec import decode_pages  # noqa: E402
from engine.registry import create_kv_storage  # noqa: E402
from agentrt_kernels.torch_ref import paged_attention  # noqa: E402
from agentrt_kernels.torch_ref.quantized_attention import quantized_paged_attention  # noqa: E402
from agentrt_kernels.triton.quant_decode import quantized_decode_attention, unsupported_shape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def page_fields(tc, x, num_pages, page_size):
    """Encode x [num_pages * page_size, H, D] and lay every field out page-shaped."""
    specs = tc.fields(x.shape[-1])
    out = {}
    for name, t in tc.encode(x).items():
        rows = page_size // tc.token_group if specs[name].per_group else page_size
        out[name] = t.reshape(num_pages, rows, *t.shape[1:]).contiguous()
    return out


def make_case(name, cfg, dtype, group, head_dim, page_size, lens, seed):
    g = torch.Generator().manual_seed(seed)
    codec = create_kv_storage(name, cfg)
    hkv, batch = 2, len(lens)
    max_pages = max(-(-n // page_size) for n in lens)
    num_pages = batch * max_pages + 1
    k = torch.randn(num_pages * page_size, hkv, head_dim, generator=g)
    v = torch.randn(num_pages * page_size, hkv, head_dim, generator=g)
    kf = {n: t.to(DEVICE) for n, t in page_fields(codec.key, k, num_pages, page_size).items()}
    vf = {n: t.to(DEVICE) for n, t in page_fields(codec.value, v, num_pages, page_size).items()}
    perm = torch.randperm(num_pages - 1, generator=g)[: batch * max_pages].view(batch, max_pages) + 1
    block_tables = perm.to(torch.int32).to(DEVICE)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    if codec.has_window:
        quant = [codec.quant_len(n) for n in lens]
        cap = codec.window_capacity
        wk = torch.randn(batch + 1, cap, hkv, head_dim, generator=g).to(dtype).to(DEVICE)
        wv = torch.randn(batch + 1, cap, hkv, head_dim, generator=g).to(dtype).to(DEVICE)
        wids = list(reversed(range(batch)))
    else:
        quant, wk, wv, wids = list(lens), None, None, None
    q = torch.randn(batch, hkv * group, head_dim, generator=g).to(dtype).to(DEVICE)
    return codec, q, kf, vf, block_tables, kv_lens, quant, wk, wv, wids


def reference(codec, q, kf, vf, block_tables, lens, quant, wk, wv, wids, page_size):
    d = q.shape[-1]
    out, _ = quantized_paged_attention(
        q.float(), lambda p: decode_pages(codec.key, kf, p, d), lambda p: decode_pages(codec.value, vf, p, d),
        block_tables, page_size, lens, quant, [1] * len(lens), d**-0.5,
        window_k=None if wk is None else wk.float(), window_v=None if wv is None else wv.float(), window_ids=wids,
        pages_per_block=2)
    return out


CASES = [("fp8", {}), ("kivi", {"bits": 4, "group_size": 8, "residual": 8}),
         ("kivi", {"bits": 2, "group_size": 8, "residual": 8}), ("turboquant", {"bits": 3}),
         ("turboquant", {"bits": 2})]
SHAPES = [(torch.float32, 2, 32, 8, 1), (torch.float16, 4, 64, 16, 3), (torch.float32, 1, 32, 16, 2)]
# Key groups a whole tile long or longer (block_n 16): the kernel folds the group's scale and zero into the
# query instead of dequantizing the tile; value groups wider and narrower than a code plane.
GROUPED = [("kivi", {"bits": 4, "group_size": 16, "residual": 16}, torch.float32, 2, 64, 16, 2),
           ("kivi", {"bits": 4, "group_size": 32, "residual": 32}, torch.float16, 4, 128, 32, 3),
           ("kivi", {"bits": 2, "group_size": 32, "residual": 0}, torch.float32, 4, 64, 32, 1),
           ("kivi", {"bits": 2, "group_size": 16, "residual": 32}, torch.float16, 2, 128, 16, 2),
           # bf16 queries: on a GPU the E4M3 kernel's dots run in fp16 (DOT_FP16)
           ("fp8", {}, torch.bfloat16, 4, 128, 16, 2),
           ("kivi", {"bits": 4, "group_size": 32, "residual": 32}, torch.bfloat16, 4, 128, 32, 2)]


def kernel_cases():
    for name, cfg in CASES:
        for dtype, group, head_dim, page_size, num_splits in SHAPES:
            if unsupported_shape(create_kv_storage(name, cfg).kernel_format, head_dim) is None:
                yield name, cfg, dtype, group, head_dim, page_size, num_splits
    yield from GROUPED


@pytest.mark.parametrize("name,cfg,dtype,group,head_dim,page_size,num_splits", list(kernel_cases()))
def test_quantized_decode_matches_reference(name, cfg, dtype, group, head_dim, page_size, num_splits):
    lens = [37, 8, 64, 1]
    codec, q, kf, vf, bt, kv_lens, quant, wk, wv, wids = make_case(name, cfg, dtype, group, head_dim, page_size,
                                                                   lens, seed=head_dim + group)
    want = reference(codec, q, kf, vf, bt, lens, quant, wk, wv, wids, page_size)
    got = quantized_decode_attention(
        q, codec.kernel_format, kf, vf, bt, kv_lens, torch.tensor(quant, dtype=torch.int32, device=DEVICE),
        wk, wv, None if wids is None else torch.tensor(wids, dtype=torch.int32, device=DEVICE), head_dim**-0.5,
        num_splits=num_splits, block_n=16, tables=codec.kernel_tables(head_dim, q.device), min_split_tokens=32)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_int_kernels_refuse_planes_narrower_than_a_dot():
    codec, q, kf, vf, bt, kv_lens, quant, wk, wv, wids = make_case(
        "kivi", {"bits": 2, "group_size": 8, "residual": 8}, torch.float32, 2, 32, 8, [9, 3], seed=0)
    with pytest.raises(ValueError, match=r"head_dim \* bits / 8 \(here 8\)"):
        quantized_decode_attention(q, codec.kernel_format, kf, vf, bt, kv_lens,
                                   torch.tensor(quant, dtype=torch.int32, device=DEVICE), wk, wv,
                                   torch.tensor(wids, dtype=torch.int32, device=DEVICE), 32**-0.5)


class _Rope:
    """A model-like rotary table: cos/sin [max_pos, D / 2] of standard RoPE (base 10000), scaled by ``attn``."""

    def __init__(self, head_dim, max_pos=256, attn=1.0):
        inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(max_pos).float()[:, None] * inv[None, :]
        self.cos_cache, self.sin_cache = angles.cos() * attn, angles.sin() * attn


@pytest.mark.parametrize("dtype,latent_dtype,group,head_dim,rank,page_size,num_splits,bias", [
    (torch.float32, torch.float32, 2, 32, 16, 8, 1, True), (torch.float16, torch.float16, 4, 64, 24, 16, 3, False),
    (torch.float32, torch.float32, 1, 16, 5, 16, 2, True), (torch.bfloat16, torch.bfloat16, 2, 32, 32, 8, 2, True)])
def test_lowrank_decode_matches_reference(dtype, latent_dtype, group, head_dim, rank, page_size, num_splits, bias):
    """Palu's latents (keys rotated back by position, a rank-r basis, a bias) decoded by the fused kernel equal
    the torch reference over the codec's own reconstruction (basis, bias, RoPE forward at each stored position;
    a YaRN-like attention scale in the tables)."""
    from policies.palu import LowRank, _RotaryTables

    g = torch.Generator().manual_seed(head_dim + rank)
    hkv, lens = 2, [37, 8, 64, 1]
    rotary = _RotaryTables(_Rope(head_dim, attn=1.1))
    bases = [torch.linalg.qr(torch.randn(hkv, head_dim, head_dim, generator=g))[0][..., :rank] for _ in "kv"]
    biases = [torch.randn(hkv, head_dim, generator=g) if bias else None for _ in "kv"]
    k_codec = LowRank(rank, latent_dtype, True, bases[0].contiguous(), biases[0], rotary)
    v_codec = LowRank(rank, latent_dtype, False, bases[1].contiguous(), biases[1])
    batch, max_pages = len(lens), max(-(-n // page_size) for n in lens)
    num_pages = batch * max_pages + 1
    n_slots = num_pages * page_size
    positions = torch.randperm(200, generator=g)[:n_slots] if n_slots <= 200 else torch.randint(0, 256, (n_slots,), generator=g)
    k = torch.randn(n_slots, hkv, head_dim, generator=g)
    v = torch.randn(n_slots, hkv, head_dim, generator=g)

    def paged(fields, rows):
        return {n: t.reshape(num_pages, rows, *t.shape[1:]).contiguous().to(DEVICE) for n, t in fields.items()}

    kf = paged(k_codec.encode(k, positions), page_size)
    vf = paged(v_codec.encode(v), page_size)
    perm = torch.randperm(num_pages - 1, generator=g)[: batch * max_pages].view(batch, max_pages) + 1
    bt = perm.to(torch.int32).to(DEVICE)
    q = torch.randn(batch, hkv * group, head_dim, generator=g).to(dtype).to(DEVICE)
    d = head_dim
    want, _ = quantized_paged_attention(
        q.float(), lambda p: decode_pages(k_codec, kf, p, d), lambda p: decode_pages(v_codec, vf, p, d), bt,
        page_size, lens, lens, [1] * batch, d**-0.5, pages_per_block=2)
    zeros = torch.zeros(hkv, head_dim)
    tables = {"k_basis": bases[0].contiguous(), "v_basis": bases[1].contiguous(),
              "k_bias": biases[0] if bias else zeros, "v_bias": biases[1] if bias else zeros,
              "cos": rotary.cos, "sin": rotary.sin}
    tables = {n: t.float().contiguous().to(DEVICE) for n, t in tables.items()}
    got = quantized_decode_attention(
        q, "lowrank-latent-rope", kf, vf, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), None, None, None, d**-0.5, num_splits=num_splits,
        block_n=16, tables=tables, min_split_tokens=32)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_reference_equals_dense_attention_over_decoded_kv():
    """The blockwise online-softmax reference is attention over the decoded context."""
    codec, q, kf, vf, bt, kv_lens, quant, wk, wv, wids = make_case(
        "kivi", {"bits": 4, "group_size": 8, "residual": 8}, torch.float32, 2, 32, 8, [37, 20], seed=7)
    got = reference(codec, q, kf, vf, bt, [37, 20], quant, wk, wv, wids, 8)
    d = 32
    for i, (n, qn) in enumerate(zip([37, 20], quant)):
        pages = bt[i].long()
        k = decode_pages(codec.key, kf, pages, d)[:n].clone()
        v = decode_pages(codec.value, vf, pages, d)[:n].clone()
        ring = torch.arange(qn, n) % wk.shape[1]
        k[qn:], v[qn:] = wk[wids[i], ring], wv[wids[i], ring]
        one = torch.arange(1, dtype=torch.int32)[None]
        want, _ = paged_attention(q[i:i + 1], k[None], v[None], one, [n], [1], d**-0.5)
        torch.testing.assert_close(got[i], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,cfg", CASES + [("palu", {"rank_ratio": 0.5, "latent_dtype": "float32"})])
def test_triton_backend_reads_the_engines_views(name, cfg, tiny_dirs, request):
    """Every decode step of a CPU engine run: the Triton backend's answer on the engine's own quantized view
    (codes, scales and windows as the cache manager wrote them) equals the torch backend's. A codec whose
    kernel cannot run at the tiny models' head_dim (32) is refused by name, and runs on the 128-wide set."""
    from engine import LLM, SamplingParams
    from engine.contract.view import QuantizedPagesView
    from engine.gpu_backends import TritonBackend
    from engine.registry import create_method

    from engine.attention_backend import quantized_forward

    triton_backend = TritonBackend()
    codec = create_kv_storage(name, cfg)
    if unsupported_shape(codec.kernel_format, 32):
        assert not triton_backend.reads_codec(codec, 32)
        reasons = triton_backend.unsupported(create_method("dense", {}), torch.float32, codec, 32)
        assert reasons == [f"the triton backend has no kernel for kv_storage {name!r} at head_dim 32"]
        tiny_dirs = request.getfixturevalue("tiny_dirs_hf_init")
    # eager: a decode graph's replay would bypass the wrapped forward below
    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=DEVICE, page_size=8, num_pages=64, kv_storage=name,
              kv_storage_config=cfg, enforce_eager=True)
    backend = llm.engine.backend
    assert triton_backend.reads_codec(llm.engine.codec, llm.engine.model_config.head_dim)
    inner, checked = backend.forward, []

    def forward(q, k_cache, v_cache, view, scale, return_scores=False):
        out, scores = inner(q, k_cache, v_cache, view, scale, return_scores)
        if isinstance(view, QuantizedPagesView) and view.is_pure_decode:
            got, _ = triton_backend.forward(q, k_cache, v_cache, view, scale)
            want, _ = quantized_forward(q, view, scale)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            checked.append(view.quant_lens_cpu)
        return out, scores

    backend.forward = forward
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (30, 13)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(checked) >= 5 * 2  # decode steps x layers


def test_triton_backend_mixed_steps_split_decode_rows(tiny_dirs):
    """A step mixing decode rows and a prefill chunk: decode rows take the kernel, the chunk the torch
    reference, and the whole answer equals the torch reference."""
    from engine import LLM, SamplingParams
    from engine.attention_backend import quantized_forward
    from engine.contract.view import QuantizedPagesView
    from engine.gpu_backends import TritonBackend

    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=DEVICE, page_size=8, num_pages=64, kv_storage="kivi",
              kv_storage_config={"bits": 4, "group_size": 8, "residual": 8}, max_num_batched_tokens=16)
    backend, triton_backend = llm.engine.backend, TritonBackend()
    inner, mixed = backend.forward, []

    def forward(q, k_cache, v_cache, view, scale, return_scores=False):
        out, scores = inner(q, k_cache, v_cache, view, scale, return_scores)
        if isinstance(view, QuantizedPagesView) and not view.is_pure_decode and 1 in view.query_lens_cpu:
            got, _ = triton_backend.forward(q, k_cache, v_cache, view, scale)
            torch.testing.assert_close(got, quantized_forward(q, view, scale)[0], rtol=2e-5, atol=2e-5)
            mixed.append(view.query_lens_cpu)
        return out, scores

    backend.forward = forward
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 40)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert mixed
