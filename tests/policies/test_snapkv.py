"""SnapKV eviction against a reference written from its paper's definition, and its memory: the pages a compaction
frees, prefix reuse short of the observation window.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule (``snap_rule``, PyramidKV's too) applied from its definition; kept positions, greedy tokens and masked greedy
tokens must agree.
"""

import pytest
import torch

import policies.snapkv  # noqa: F401
from tests.eviction_reference import (
    PROMPT_LENS,
    check_against_reference,
    make_llm,
    make_prompts,
    params,
    run_recorded,
    snap_rule,
)


# --- SnapKV ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,pooling,reeval", [("qwen3", "max", 0), ("llama", "avg", 0), ("qwen3", "avg", 3),
                                                 ("llama", "max", 5), ("deepseek_v3", "max", 0),
                                                 ("glm4_moe_lite", "avg", 3)])
def test_snapkv_matches_reference(arch, pooling, reeval, tiny_dirs):
    cfg = dict(budget=16, window=6, kernel_size=3, pooling=pooling, reeval_every=reeval)
    prompts = make_prompts(PROMPT_LENS, seed=1)
    llm = make_llm(tiny_dirs[arch], "snapkv", cfg)
    outs, history = run_recorded(llm, prompts)
    for out in outs:  # right after the prompt: exactly `budget` slots per layer for the long prompts
        P = len(out.prompt_token_ids)
        kept = first_kept_after_prompt(history[out.request_id], P)
        assert [k.shape[1] for k in kept] == [min(P, 16)] * 2
    assert any(P - 6 < boundary < P for P, boundary in chunk_boundaries(outs, history))  # a split window
    check_against_reference(llm, prompts, outs, history,
                            lambda P: snap_rule(P, [16, 16], 6, 3, pooling, reeval, budget=16))


@pytest.mark.parametrize("arch", ["llama", "glm4_moe_lite"])
def test_snapkv_layers_voting_one_per_call_match_reference(arch, tiny_dirs, monkeypatch):
    """With the vote's partial buffers capped below one layer's (``VOTE_PARTIALS_BYTES``, a long context's case)
    each layer votes in its own call over the whole pool: still the definition's kept positions and tokens."""
    import policies.scoring as scoring

    calls = []
    original = scoring.window_vote_inputs

    def counting(pages, n, w, device, page_offsets=None):
        calls.append(None if page_offsets is None else len(page_offsets))
        return original(pages, n, w, device, page_offsets)

    monkeypatch.setattr(scoring, "VOTE_PARTIALS_BYTES", 1)
    monkeypatch.setattr(scoring, "window_vote_inputs", counting)
    prompts = make_prompts(PROMPT_LENS, seed=1)
    llm = make_llm(tiny_dirs[arch], "snapkv", dict(budget=16, window=6, kernel_size=3, pooling="max"))
    outs, history = run_recorded(llm, prompts)
    assert calls and set(calls) == {1}  # every grouped vote split into one call a layer
    check_against_reference(llm, prompts, outs, history, lambda P: snap_rule(P, [16, 16], 6, 3, "max", 0, budget=16))


def chunk_boundaries(outs, history):
    for out in outs:
        done = 0
        for n, _ in history[out.request_id]:
            done += n
            yield len(out.prompt_token_ids), done


# --- memory ---------------------------------------------------------------------------------------------------
def test_snapkv_compaction_frees_pages_that_another_request_reuses(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"], "snapkv", dict(budget=16, window=4), chunk=32, num_pages=20)
    engine, cache, pool = llm.engine, llm.engine.cache, llm.engine.pool
    before_compaction = {}
    inner = engine.method.end_step

    def end_step(batch):
        for req in batch.finished_prompt:
            before_compaction[req.request_id] = list(cache.table(req).pages)
        inner(batch)

    engine.method.end_step = end_step
    a_prompt, b_prompt = make_prompts((64, 40), seed=5)
    a = engine.add_request(a_prompt, params(4))
    b = engine.add_request(b_prompt, params(4))
    req_a = engine._requests[a]
    engine.step()  # A: 32 prompt tokens (8 pages); B waits for the token budget
    engine.step()  # A: the last 32 (16 pages held, 4 free), then SnapKV keeps 16 slots = ceil(16 / 4) pages
    assert req_a.num_computed_tokens == 64 and engine._requests[b].num_computed_tokens == 0
    assert len(before_compaction[a]) == 16
    assert cache.num_pages_held(req_a) == 4 and pool.num_free == 16
    released = set(before_compaction[a]) - set(cache.table(req_a).pages)
    assert len(released) == 12
    engine.step()  # A decodes (17 slots: 5 pages); B is admitted with 31 tokens (8 pages): 4 free pages would not do
    req_b = engine._requests[b]
    assert req_b.num_computed_tokens == 31
    assert cache.num_pages_held(req_a) == 5 and cache.num_pages_held(req_b) == 8 and pool.num_free == 7
    assert len(set(cache.table(req_b).pages) & released) == 8 - (4 - 1)  # the never-used pages go first
    while engine.has_unfinished():
        engine.step()
    assert pool.num_free == 20


def test_snapkv_prefix_reuse_never_covers_the_observation_window(tiny_dirs):
    """A dense-kept 36-token prompt publishes 9 pages; a 40-token prompt extending it would reuse all 36
    tokens, but its window [32, 40) must be computed, so it reuses 32 and keeps what a cold run keeps."""
    cfg = dict(budget=36, window=8)
    b_prompt = make_prompts((40,), seed=6)[0]
    cold, cold_history = run_recorded(make_llm(tiny_dirs["qwen3"], "snapkv", cfg), [b_prompt])
    llm = make_llm(tiny_dirs["qwen3"], "snapkv", cfg)
    llm.generate([b_prompt[:36]], params(2))  # P <= budget: never compacted, its pages stay published
    warm, warm_history = run_recorded(llm, [b_prompt])
    assert cold[0].num_cached_tokens == 0 and warm[0].num_cached_tokens == 32
    kept_cold = first_kept_after_prompt(cold_history[cold[0].request_id], 40)
    kept_warm = first_kept_after_prompt(warm_history[warm[0].request_id], 40, cached=32)
    assert [k.shape[1] for k in kept_warm] == [36, 36]
    assert all(torch.equal(x, y) for x, y in zip(kept_cold, kept_warm))
    assert warm[0].token_ids == cold[0].token_ids


def first_kept_after_prompt(history, prompt_len, cached=0):
    done = cached
    for n, kept in history:
        done += n
        if done >= prompt_len:
            return kept
    raise AssertionError("the prompt never finished")
