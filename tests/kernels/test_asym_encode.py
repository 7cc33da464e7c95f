"""The fused encode-and-store kernels of the asymmetric integer format against the torch definition
(``policies/kivi.py``'s codecs, then the cache manager's index copies): every code, scale and zero equal.
Runs compiled on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1) at tiny sizes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.triton.asym_encode import encode_channel_groups, encode_token_groups  # noqa: E402
from policies.kivi import PerChannelKeys, PerTokenValues  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, heads, d, dtype, seed, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g) * 3
    if kind == "ties":  # values on the half-levels between codes, constant runs, zeros and a spread of scales
        x = (torch.randint(0, 31, (n, heads, d), generator=g).float() / 2) * 0.25
        x[: n // 2, 0] = 1.5
        x[:, -1, : d // 2] = 0.0
        x = x * torch.logspace(-3, 2, d)[None, None, :]
    return x.to(dtype).to(DEVICE)


def _reference(codec, x, slots, num_slots, spec_rows):
    """codec.encode + the per-field index copies ``CodedStorage.store`` makes."""
    out = {}
    specs = codec.fields(x.shape[-1])
    for name, value in codec.encode(x).items():
        rows = num_slots // codec.token_group if specs[name].per_group else num_slots
        dst = torch.zeros(rows, x.shape[1], specs[name].width, dtype=specs[name].dtype, device=x.device)
        idx = slots[:: codec.token_group] // codec.token_group if specs[name].per_group else slots
        dst.index_copy_(0, idx, value.to(dst.dtype))
        out[name] = dst
    return out


def _empty_like_fields(ref):
    return {k: torch.zeros_like(v) for k, v in ref.items()}


@pytest.mark.parametrize("dtype,bits,group,d,kind", [
    (torch.float32, 4, 8, 32, "normal"), (torch.float16, 2, 16, 64, "normal"), (torch.bfloat16, 4, 32, 128, "ties"),
    (torch.float32, 2, 8, 64, "ties")])
def test_channel_groups_equal_the_key_codec(dtype, bits, group, d, kind):
    heads, runs, num_slots = 3, 4, 256
    x = _inputs(runs * group, heads, d, dtype, 1, kind)
    page_runs = torch.randperm(num_slots // group)[:runs]  # each run lands on its own group of slots
    slots = (page_runs[:, None] * group + torch.arange(group)).flatten().to(DEVICE)
    codec = PerChannelKeys(bits, group)
    ref = _reference(codec, x, slots, num_slots, None)
    got = _empty_like_fields(ref)
    encode_channel_groups(x, slots, got["codes"], got["scale"], got["zero"], bits, group)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("dtype,bits,group,d,n,kind", [
    (torch.float32, 4, 8, 32, 37, "normal"), (torch.float16, 2, 16, 64, 16, "ties"),
    (torch.bfloat16, 4, 32, 128, 5, "ties"), (torch.float32, 4, 32, 64, 1, "normal")])
def test_token_groups_equal_the_value_codec(dtype, bits, group, d, n, kind):
    heads, num_slots = 2, 128
    x = _inputs(n, heads, d, dtype, 2, kind)
    slots = torch.randperm(num_slots)[:n].to(DEVICE)
    codec = PerTokenValues(bits, group)
    ref = _reference(codec, x, slots, num_slots, None)
    got = _empty_like_fields(ref)
    encode_token_groups(x, slots, got["codes"], got["scale"], got["zero"], bits, group, block_t=16)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_bad_shapes_are_refused():
    x = torch.zeros(8, 2, 48, device=DEVICE)
    codes = torch.zeros(8, 2, 24, dtype=torch.uint8, device=DEVICE)
    half = torch.zeros(8, 2, 48, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        encode_token_groups(x, torch.arange(8, device=DEVICE), codes, half, half, 4, 16)


@pytest.mark.parametrize("bits", [4, 2])
def test_engine_with_the_fused_encode_stores_the_same_bytes(bits, tiny_dirs, monkeypatch):
    """KIVI through the engine's write plans (prompt chunks, decode steps re-encoding the open key group from
    the window): with the kernel forced on (the interpreter on a CPU), every stored field and every greedy
    token equal the torch encode's."""
    import policies.kivi
    from engine import LLM, SamplingParams

    def run():
        llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=DEVICE, page_size=8, max_num_batched_tokens=32,
                  kv_storage="kivi", kv_storage_config={"bits": bits, "group_size": 8, "residual": 16},
                  num_pages=64, enable_prefix_caching=False, enforce_eager=True)
        g = torch.Generator().manual_seed(3)
        ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (45, 20)]
        outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        coded = llm.engine.cache.storage
        return [o.token_ids for o in outs], {(side, name): t.clone() for side, fields in coded.fields.items()
                                            for name, t in fields.items()}

    import agentrt_kernels.triton.asym_encode as fused

    monkeypatch.setattr(policies.kivi, "use_kernel", lambda x: False)
    want_tokens, want_fields = run()
    calls = []
    for name in ("encode_channel_groups", "encode_token_groups"):
        kernel = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
    monkeypatch.setattr(policies.kivi, "use_kernel", lambda x: True)
    got_tokens, got_fields = run()
    assert len(calls) > 20 and got_tokens == want_tokens
    for key, t in want_fields.items():
        assert torch.equal(got_fields[key], t), key


def test_strided_rows_as_a_prompt_write_hands_them():
    """A prompt chunk's keys and values reach ``store`` as views of the packed qkv projection (row stride
    larger than H * D): the kernels read them in place and store what the torch encode stores."""
    d, bits = 64, 4
    packed = _inputs(32, 6, d, torch.float16, 4, "normal")  # [N, q + k + v heads, D]
    k, v = packed[:, 2:4], packed[:, 4:6]
    assert not k.is_contiguous()
    slots = torch.arange(32, device=DEVICE) + 16
    for codec, x, kernel, group in ((PerChannelKeys(bits, 8), k, encode_channel_groups, 8),
                                    (PerTokenValues(bits, 16), v, encode_token_groups, 16)):
        ref = _reference(codec, x.contiguous(), slots, 128, None)
        got = _empty_like_fields(ref)
        kernel(x, slots, got["codes"], got["scale"], got["zero"], bits, group)
        for name in ref:
            assert torch.equal(got[name], ref[name]), name
