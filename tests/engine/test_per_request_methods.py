"""Per-request methods: one engine serves requests of several sparse methods in the same continuous batch.

Reference: each request run alone on an engine *configured* with its method (the single-method path, whose
methods are checked against their papers' definitions in the method tests). In a mixed batch with chunked
prefill every request must emit exactly the reference's greedy tokens (fp32) with its log-probabilities.
"""

import pytest
import torch

import policies  # noqa: F401  (registers the built-in methods)
from engine import LLM, SamplingParams
from engine.contract.method import SparseMethod
from engine.errors import ConfigError
from engine.paged_cache import PagedCacheManager
from engine.registry import METHODS

MIXED = [  # (method, config) per request; None = the engine's configured method
    (None, None),
    ("snapkv", {"budget": 24, "window": 8}),
    ("quest", {"token_budget": 16, "dense_layers": 1}),
    ("h2o", {"heavy_budget": 12, "recent_budget": 12}),
    ("streaming_llm", {"sink_tokens": 4, "window": 20}),
    ("snapkv", {"budget": 24, "window": 8}),  # shares the instance of request 1
    ("omnikv", {"token_budget": 16}),
    ("dense", {}),
]
PROMPT_LENS = [37, 61, 45, 70, 29, 53, 66, 41]
# methods whose output does not depend on how a prompt is chunked (H2O and StreamingLLM evict between chunks)
CHUNK_INDEPENDENT = [i for i, (m, _) in enumerate(MIXED) if m not in ("h2o", "streaming_llm")]


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)


def make_llm(model_dir, method="dense", cfg=None, chunk=4096):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=chunk, method=method,
               method_config=cfg or {})


def run(engine, items):
    """items: (prompt, method, config); returns the finished outputs in input order."""
    ids = [engine.add_request(p, PARAMS, method=m, method_config=c) for p, m, c in items]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize("arch,chunk,which", [("qwen3", 4096, range(len(MIXED))), ("qwen3", 48, CHUNK_INDEPENDENT),
                                              ("deepseek_v3", 48, CHUNK_INDEPENDENT)])
def test_mixed_batch_equals_each_method_alone(tiny_dirs, arch, chunk, which):
    ps = [prompts()[i] for i in which]
    methods = [MIXED[i] for i in which]
    engine = make_llm(tiny_dirs[arch], chunk=chunk).engine
    steps_with_several = []
    step = engine.step

    def counting_step():
        outs = step()
        batch_methods = {id(r.method) for r in engine._requests.values() if r.num_computed_tokens > 0}
        steps_with_several.append(len(batch_methods) > 1)
        return outs

    engine.step = counting_step
    mixed = run(engine, [(p, m, c) for p, (m, c) in zip(ps, methods)])
    assert any(steps_with_several)
    for p, (m, c), got in zip(ps, methods, mixed):
        (ref,) = make_llm(tiny_dirs[arch], m or "dense", c, chunk=chunk).generate([p], PARAMS)
        assert got.token_ids == ref.token_ids, (m, c)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=1e-4)


def test_llm_generate_takes_a_method_per_prompt(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"])
    ps = prompts()[:3]
    methods = [None, ("snapkv", {"budget": 24, "window": 8}), ("quest", {"token_budget": 16, "dense_layers": 1})]
    outs = llm.generate(ps, PARAMS, methods=methods)
    for p, m, out in zip(ps, methods, outs):
        name, cfg = m or ("dense", {})
        assert out.token_ids == make_llm(tiny_dirs["qwen3"], name, cfg).generate([p], PARAMS)[0].token_ids
    with pytest.raises(ConfigError):
        llm.generate(ps, PARAMS, methods=[None, ("nope", {}), None])
    assert not llm.engine.has_unfinished()  # nothing left queued


def test_methods_are_shared_per_configuration_and_checked_once(tiny_dirs):
    engine = make_llm(tiny_dirs["qwen3"]).engine
    a = engine.methods.resolve("snapkv", {"budget": 24, "window": 8})
    assert engine.methods.resolve("snapkv", {"budget": 24, "window": 8}) is a
    assert engine.methods.resolve("snapkv", {"budget": 32, "window": 8}) is not a
    assert engine.methods.resolve(None) is engine.method


@pytest.mark.parametrize("method,cfg,match", [
    ("nope", {}, "unknown method 'nope'"),
    ("snapkv", {"budget": 8, "window": 16}, "window"),
    ("omnikv", {"observation_layers": [9]}, "observation layer 9 does not exist"),
    (None, {"budget": 8}, "method_config was given without a method"),
])
def test_a_bad_method_fails_at_add_request_and_changes_nothing(tiny_dirs, method, cfg, match):
    engine = make_llm(tiny_dirs["qwen3"]).engine
    with pytest.raises(ConfigError, match=match):
        engine.add_request([5, 6, 7, 8, 9], PARAMS, method=method, method_config=cfg)
    assert not engine.has_unfinished() and engine.pool.num_used == 0


def test_the_number_of_method_configurations_is_bounded(tiny_dirs):
    engine = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, max_methods=3).engine
    for budget in (24, 32):
        engine.methods.resolve("snapkv", {"budget": budget, "window": 8})
    engine.methods.resolve("snapkv", {"budget": 24, "window": 8})  # a known one is still served
    with pytest.raises(ConfigError, match="already serves 3 method configurations"):
        engine.add_request([5, 6, 7, 8, 9], PARAMS, method="snapkv", method_config={"budget": 40, "window": 8})
    assert not engine.has_unfinished()


def test_a_method_with_its_own_cache_layout_is_only_an_engine_method(tiny_dirs):
    class OwnLayout(SparseMethod):
        name = "test_own_layout"

        def make_cache(self, spec, pool, enable_prefix_caching):
            return PagedCacheManager(spec, pool, enable_prefix_caching=False)

    METHODS.register(OwnLayout)
    engine = make_llm(tiny_dirs["qwen3"]).engine
    with pytest.raises(ConfigError, match="builds its own cache layout"):
        engine.add_request([5, 6, 7, 8, 9], PARAMS, method="test_own_layout")
    (out,) = make_llm(tiny_dirs["qwen3"], "test_own_layout").generate([[5, 6, 7, 8, 9]], PARAMS)
    assert len(out.token_ids) == PARAMS.max_tokens


def test_prefix_cache_pages_are_not_shared_across_methods(tiny_dirs):
    engine = make_llm(tiny_dirs["qwen3"]).engine
    p = prompts(1)[3]
    quest = ("quest", {"token_budget": 16, "dense_layers": 1})
    first = run(engine, [(p, None, None), (p, *quest)])
    assert [o.num_cached_tokens for o in first] == [0, 0]
    again = run(engine, [(p, None, None), (p, *quest)])
    assert all(o.num_cached_tokens >= len(p) // 4 * 4 - 4 for o in again)  # each hits its own method's pages
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def finish(engine, prompt, **kw):
    rid = engine.add_request(prompt, PARAMS, **kw)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                last = out
    return last


def test_a_chain_resumed_by_another_method_is_recomputed(tiny_dirs):
    engine = make_llm(tiny_dirs["qwen3"]).engine
    first = finish(engine, prompts(2)[0], chain_id="c")
    second = finish(engine, first.prompt_token_ids + first.token_ids + [7, 8, 9], chain_id="c")
    assert second.resume_status == "resumed"
    snap = {"method": "snapkv", "method_config": {"budget": 24, "window": 8}}
    history = second.prompt_token_ids + second.token_ids + [10, 11]
    third = finish(engine, history, chain_id="c", **snap)
    assert third.resume_status == "recomputed" and third.num_resumed_tokens == 0
    (ref,) = make_llm(tiny_dirs["qwen3"], snap["method"], snap["method_config"]).generate([history], PARAMS)
    assert third.token_ids == ref.token_ids
    fourth = finish(engine, third.prompt_token_ids + third.token_ids + [12], chain_id="c", **snap)
    assert fourth.resume_status == "resumed"  # the chain now holds the SnapKV state
