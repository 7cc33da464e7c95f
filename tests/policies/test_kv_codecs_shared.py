"""KV storage codecs (FP8, KIVI, TurboQuant) together, and their composition with eviction: bad configs, exact
bytes per token and pages at a fixed budget, log-probabilities close to dense, compaction moving codes with their
scales, every eviction method with every codec, SnapKV's vote over coded keys. Each codec against its definition:
tests/policies/test_fp8_kv.py, test_kivi.py, test_turboquant.py (their references: tests/codec_reference.py).
"""

import math

import pytest
import torch

import policies.streaming_llm  # noqa: F401  (registers the method)
from engine import SamplingParams
from engine.contract.cache import CacheSpec
from engine.contract.codec import CodedCacheSpec
from engine.errors import ConfigError
from engine.page_table import physical_slots
from engine.registry import create_kv_storage
from tests.codec_reference import EVICTION_CONFIGS, KIVI, PAGE, DenseRunner, kivi_keys, make_llm, prompts


# --- configuration --------------------------------------------------------------------------------------------
def test_bad_storage_config_is_a_config_error(tiny_dirs):
    with pytest.raises(ConfigError, match="no option"):
        create_kv_storage("kivi", {"bitz": 4})
    with pytest.raises(ConfigError, match="bits"):
        create_kv_storage("kivi", {"bits": 3})
    with pytest.raises(ConfigError, match="unknown kv_storage"):
        create_kv_storage("int3")
    with pytest.raises(ConfigError, match="multiple of it"):
        make_llm(tiny_dirs["qwen3"], "kivi", {"group_size": 16, "residual": 16})  # page_size 8
    with pytest.raises(ConfigError, match="does not compose"):
        make_llm(tiny_dirs["qwen3"], "fp8", method="quest", mcfg={"token_budget": 16})


# --- memory ---------------------------------------------------------------------------------------------------
def spec_8b(dtype=torch.bfloat16, page_size=32):
    return CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype, device=torch.device("cpu"),
                     page_size=page_size)


def expected_bytes_per_token(name, cfg, L=32, H=8, D=128):
    """Bytes per token from the formats' definitions (codes + every scale, zero and norm)."""
    if name == "fp8":
        per_head = 2 * (D * 1 + 4)  # E4M3 codes + one fp32 scale, for K and V
    elif name == "kivi":
        b, g = cfg["bits"], cfg["group_size"]
        per_head = (D * b / 8 + 2 * 2 * D / g) + (D * b / 8 + 2 * 2 * D / g)  # keys: (s, z) per channel per g tokens
    else:
        per_head = 2 * (D * cfg["bits"] / 8 + 4)
    return L * H * per_head


@pytest.mark.parametrize("name,cfg,ratio", [
    ("fp8", {}, 1.94), ("kivi", {"bits": 4, "group_size": 32, "residual": 128}, 3.2),
    ("kivi", {"bits": 4, "group_size": 128, "residual": 128}, 3.76),
    ("kivi", {"bits": 2, "group_size": 32, "residual": 128}, 5.33),
    ("kivi", {"bits": 2, "group_size": 128, "residual": 128}, 7.11),
    ("turboquant", {"bits": 3}, 4.92), ("turboquant", {"bits": 4}, 3.76)])
def test_bytes_per_token_and_pages_at_a_fixed_budget(name, cfg, ratio):
    dense = spec_8b()
    codec = create_kv_storage(name, cfg)
    spec = CodedCacheSpec(**{f: getattr(dense, f) for f in CacheSpec.__dataclass_fields__}, codec=codec,
                          max_windows=64 if codec.has_window else 0)
    want = expected_bytes_per_token(name, cfg)
    assert spec.bytes_per_token == want and spec.bytes_per_page == want * 32
    assert dense.bytes_per_token == 32 * 8 * 2 * 128 * 2
    assert round(dense.bytes_per_token / want, 2) == ratio
    budget = 64 * 2**30  # what an H200 has left for KV next to an 8B model, about
    window = 64 * (cfg.get("residual", 0) + cfg.get("group_size", 1)) * dense.bytes_per_token if codec.has_window else 0
    assert spec.window_bytes == window
    pages = (budget - window) // (want * 32)
    capacity = pages * 32 // 32768  # 32K-token requests that fit
    dense_capacity = budget // dense.bytes_per_page * 32 // 32768
    print(f"{name} {cfg}: {want / 32 / 8:.1f} B/token/layer/head, {capacity} vs {dense_capacity} requests of 32K")
    assert capacity / dense_capacity >= ratio * 0.95  # the windows (64 x (residual + group) tokens) cost a little


@pytest.mark.parametrize("name,cfg", [("fp8", {}), ("kivi", KIVI), ("kivi", {**KIVI, "bits": 2})])
def test_engine_pool_and_snapkv_pages(name, cfg, tiny_dirs):
    """At one byte budget the pool holds budget // page bytes pages (windows taken out first); SnapKV keeps
    the same slots with or without a codec, so a request holds the same number of (smaller) pages."""
    budget = 2**22
    dense = make_llm(tiny_dirs["qwen3"], method="snapkv", mcfg={"budget": 24, "window": 8}, num_pages=None,
                     kv_cache_memory_bytes=budget, max_num_seqs=4)
    coded = make_llm(tiny_dirs["qwen3"], name, cfg, method="snapkv", mcfg={"budget": 24, "window": 8}, num_pages=None,
                     kv_cache_memory_bytes=budget, max_num_seqs=4)
    L, H, D = 2, 2, 32  # the tiny Qwen3
    dense_token = 2 * L * H * D * 4
    assert dense.engine.pool.num_pages == budget // (dense_token * PAGE)
    per_token = expected_bytes_per_token(name, cfg, L, H, D)
    windows = 4 * (KIVI["residual"] + KIVI["group_size"]) * dense_token if name == "kivi" else 0
    assert coded.engine.pool.num_pages == (budget - windows) // (per_token * PAGE)
    held = {}
    for llm in (dense, coded):
        cache, ps = llm.engine.cache, prompts([70, 45])
        seen = []
        inner = llm.engine.method.end_step

        def end_step(batch, inner=inner, cache=cache, seen=seen):
            inner(batch)
            seen.extend(cache.num_pages_held(r) for r in batch.requests if r.num_computed_tokens == r.num_prompt_tokens)

        llm.engine.method.end_step = end_step
        llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        held[llm is coded] = seen
        assert all(r == 0 for r in llm.engine.pool.ref_counts)
    assert held[True] == held[False] == [math.ceil(24 / PAGE)] * 2


# --- attention and tokens -------------------------------------------------------------------------------------
def forced_logprobs(llm, prompt, forced):
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(forced), forced_token_ids=forced,
                                                logprobs=True, ignore_eos=True))[0]
    assert out.token_ids == forced
    return torch.tensor(out.logprobs)


# max |logprob - dense| over 30 forced tokens after a 60-token prompt on the tiny random Qwen3 (whose
# logits are unusually sensitive: weights N(0, 0.1)). Measured: fp8 0.11, kivi-4 0.14, kivi-2 0.75,
# turboquant-4 0.38, turboquant-3 0.54; the stated tolerance is about twice that.
LOGPROB_TOLERANCE = {("fp8", None): 0.25, ("kivi", 4): 0.3, ("kivi", 2): 1.5, ("turboquant", 4): 0.75,
                     ("turboquant", 3): 1.1}


@pytest.mark.parametrize("name,bits", list(LOGPROB_TOLERANCE))
def test_logprobs_close_to_dense(name, bits, tiny_dirs):
    cfg = {} if bits is None else ({**KIVI, "bits": bits} if name == "kivi" else {"bits": bits})
    prompt = prompts([60])[0]
    forced = prompts([30], seed=5)[0]
    dense = forced_logprobs(make_llm(tiny_dirs["qwen3"]), prompt, forced)
    coded = forced_logprobs(make_llm(tiny_dirs["qwen3"], name, cfg), prompt, forced)
    err = (coded - dense).abs().max().item()
    print(f"{name}-{bits}: max |d logprob| = {err:.4f}")
    assert err < LOGPROB_TOLERANCE[name, bits]


# --- compaction, eviction -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,cfg", [("fp8", {}), ("kivi", KIVI), ("turboquant", {"bits": 4})])
def test_compaction_moves_codes_with_their_scales(name, cfg, tiny_dirs):
    """Compact a coded request to per-head subsets, append one token, attend: the result is dense attention
    over (token-local codecs) the very values stored before, moved; (KIVI) values moved, keys re-encoded in
    groups over the kept slots, recent slots from the full-precision window."""
    from engine.attention_backend import quantized_forward

    llm = make_llm(tiny_dirs["qwen3"], name, cfg)
    eng, codec = llm.engine, llm.engine.codec
    cache = eng.cache
    req = eng._requests[eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=4))]
    n, m, heads, d = 50, 29, 2, 32
    g = torch.Generator().manual_seed(3)
    kv = [(torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)) for _ in range(2)]
    assert cache.allocate(req, n)
    for layer, (k, v) in enumerate(kv):
        cache.write_prefix(req, layer, k, v)
    cache.commit(req, n)
    slots = physical_slots(cache.table(req).pages, 0, n, cache.page_size, cache.spec.device)
    stored = [tuple(x.flatten(0, 1)[slots] for x in cache.layer_kv(layer)) for layer in range(2)]
    keep = [torch.stack([torch.randperm(n, generator=g)[:m].sort().values for _ in range(heads)]) for _ in range(2)]
    assert cache.compact(req, keep) and cache.physical_len(req, 1) == m
    assert cache.allocate(req, 1)
    sm = cache.slot_mapping([req], [1])
    views = cache.build_layer_views([req], [1])
    q_len = codec.quant_len(n)
    for layer, ((k, v), (sk, sv), kp) in enumerate(zip(kv, stored, keep)):
        pick = lambda x: torch.stack([x[kp[h], h] for h in range(heads)], 1)  # noqa: E731  [m, H, D]
        in_window = (kp >= q_len).T[..., None]
        if name == "kivi":
            full_k = torch.where(in_window, pick(k), pick(sk))
            qm = codec.quant_len(m)
            pad = -(-m // 8) * 8
            kq, _ = kivi_keys(torch.cat([full_k, full_k[-1:].expand(pad - m, -1, -1)]), 4, 8)
            want_k = torch.cat([kq[:qm], full_k[qm:]])
            want_v = torch.cat([pick(sv)[:qm], torch.where(in_window, pick(v), pick(sv))[qm:]])
        else:
            want_k, want_v = pick(sk), pick(sv)
        k1, v1 = torch.randn(1, heads, d, generator=g), torch.randn(1, heads, d, generator=g)
        cache.write(layer, k1, v1, sm)
        q = torch.randn(1, 4, d, generator=g)
        got, _ = quantized_forward(q, views[layer], d**-0.5)
        new_k = k1 if codec.has_window else torch.stack([cache.layer_kv(layer)[0].flatten(0, 1)[sm]])[0]
        new_v = v1 if codec.has_window else torch.stack([cache.layer_kv(layer)[1].flatten(0, 1)[sm]])[0]
        want = DenseRunner.attend(q, torch.cat([want_k, new_k]), torch.cat([want_v, new_v]),
                                  torch.ones(heads, 1, m + 1, dtype=torch.bool))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache.commit(req, 1)
    eng.abort(req.request_id)
    assert all(r == 0 for r in eng.pool.ref_counts)


EVICTION = {m: cfg for m, cfg in EVICTION_CONFIGS.items() if m != "kvzip"}  # the eviction methods without a probe


@pytest.mark.parametrize("method", list(EVICTION))
@pytest.mark.parametrize("name,cfg", [("fp8", {}), ("kivi", KIVI), ("turboquant", {"bits": 3})])
def test_every_eviction_method_composes_with_every_codec(method, name, cfg, tiny_dirs):
    """The pair runs through the same contract: each layer ends holding exactly the slots the method alone
    holds (budgets fix the counts), and every page and window comes back."""
    lens = {}
    for storage in (None, name):
        llm = make_llm(tiny_dirs["qwen3"], storage, cfg if storage else None, method=method, mcfg=EVICTION[method])
        eng = llm.engine
        seen = lens.setdefault(storage, [])
        inner = eng.method.end_step

        def end_step(batch, inner=inner, eng=eng, seen=seen):
            inner(batch)
            seen.append([[eng.cache.physical_len(r, layer) for layer in range(2)] for r in batch.requests])

        eng.method.end_step = end_step
        outs = llm.generate(prompts([50, 33]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert all(len(o.token_ids) == 12 for o in outs)
        assert all(r == 0 for r in eng.pool.ref_counts)
        if storage is not None and eng.codec.has_window:
            assert len(eng.cache.storage._free_windows) == eng.config.max_num_seqs
    assert lens[None] == lens[name]


@pytest.mark.parametrize("name,cfg", [("fp8", {}), ("kivi", KIVI)])
def test_snapkv_vote_over_coded_keys_equals_the_definition(name, cfg, tiny_dirs):
    """At a prompt's end (window rows = the last slots) SnapKV's vote over coded keys goes through
    ``window_votes`` on the keys decoded once into pages; it equals the fp32 window-score definition over the
    same decoded keys, for a length that ends inside a page."""
    from policies.scoring import gather_keys, held_window_scores, window_scores

    llm = make_llm(tiny_dirs["qwen3"], name, cfg)
    eng = llm.engine
    cache = eng.cache
    req = eng._requests[eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=4))]
    n, w, heads, d = 45, 6, 2, 32  # 45 = 5 pages of 8 + 5
    g = torch.Generator().manual_seed(5)
    assert cache.allocate(req, n)
    for layer in range(2):
        cache.write_prefix(req, layer, torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g))
    cache.commit(req, n)
    q = torch.randn(w, 4, d, generator=g)
    q_pos = torch.arange(n - w, n)
    k_pos = torch.arange(n).expand(heads, n)
    for layer in range(2):
        got = held_window_scores(cache, req, layer, q, q_pos, k_pos)
        want = window_scores(q, gather_keys(cache, req, layer, n), q_pos, k_pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    eng.abort(req.request_id)
