"""Prefix caching on hybrid models (engine.storage.recurrent): a recurrent layer's state exists only at a table's
end, so prefill chunks end on page boundaries and the state there is kept as a checkpoint under the page's
prefix key; a request sharing a prefix starts from the last matched page with a checkpoint.

References: a fresh engine without prefix caching on the same prompt (itself equal to HF transformers in
test_engine_vs_hf) for every output; the expected reuse from the chunk arithmetic (where the chunks ended)."""

import random

import pytest

from engine import LLM, SamplingParams
from tests.chain_helpers import random_tokens

PAGE = 4
BUDGET = 18  # a step's tokens: chunks of a long prompt end at 16, 32, 48, ... (the page grid below 18, 34, ...)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True)


def _llm(model_dir, **options):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=BUDGET, **options)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model(request, tiny_dirs):
    return tiny_dirs[request.param]


def test_a_shared_prefix_resumes_at_the_last_checkpoint_and_matches_a_fresh_run(model):
    llm, ref = _llm(model), _llm(model, enable_prefix_caching=False)
    rng = random.Random(0)
    shared = random_tokens(rng, 43)
    first = shared + random_tokens(rng, 10)
    a = llm.generate([first], PARAMS)[0]
    assert a.num_cached_tokens == 0
    # the first prompt ran in chunks ending at 16, 32, 48 (aligned) and 53 (its end): checkpoints at 16, 32, 48
    assert len(llm.engine.cache.storage.checkpoints) == 3
    for n_new in (5, 12):
        second = shared + random_tokens(rng, n_new)
        b = llm.generate([second], PARAMS)[0]
        assert b.num_cached_tokens == 32  # 43 tokens shared: the page ending at 48 differs
        expect = ref.generate([second], PARAMS)[0]
        assert b.token_ids == expect.token_ids
        assert b.logprobs == pytest.approx(expect.logprobs, abs=1e-5)


def test_without_checkpoints_nothing_is_reused_and_chunks_are_not_aligned(model):
    llm = _llm(model, prefix_checkpoints=0)
    prompt = random_tokens(random.Random(1), 40)
    llm.generate([prompt], PARAMS)
    again = llm.generate([prompt + [7, 8]], PARAMS)[0]
    assert again.num_cached_tokens == 0 and llm.engine.cache.prefix is None


def test_checkpoints_beyond_the_limit_go_least_recently_used_first(model):
    llm, ref = _llm(model, prefix_checkpoints=2), _llm(model, enable_prefix_caching=False)
    rng = random.Random(2)
    prompt = random_tokens(rng, 60)  # chunks end at 16, 32, 48 (and 60): the checkpoint at 16 is dropped
    llm.generate([prompt], PARAMS)
    assert len(llm.engine.cache.storage.checkpoints) == 2
    longer = prompt[:50] + random_tokens(rng, 6)  # resumes at 48, the older of the two kept
    out = llm.generate([longer], PARAMS)[0]
    assert out.num_cached_tokens == 48 and out.token_ids == ref.generate([longer], PARAMS)[0].token_ids
    head = prompt[:20] + random_tokens(rng, 6)  # shares 20 tokens: its only checkpoint (16) was dropped
    out = llm.generate([head], PARAMS)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == ref.generate([head], PARAMS)[0].token_ids


def test_a_batch_of_requests_sharing_a_prefix_equals_fresh_runs(model):
    """Requests admitted together and one after another, chunks interleaved with decodes: every output equals a
    fresh run's, and every page and state slot is given back."""
    llm, ref = _llm(model), _llm(model, enable_prefix_caching=False)
    rng = random.Random(3)
    shared = random_tokens(rng, 37)
    prompts = [shared + random_tokens(rng, rng.choice([2, 7, 19])) for _ in range(5)]
    llm.generate(prompts[:1], PARAMS)
    outs = llm.generate(prompts, PARAMS)
    refs = ref.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [len(p) for p in prompts] == [56, 44, 56, 44, 44]
    # the first prompt ran alone before (checkpoints at 16, 32, 48 of its own pages); the others share 37 tokens
    assert [o.num_cached_tokens for o in outs] == [48, 32, 32, 32, 32]
    engine = llm.engine
    assert all(engine.pool.ref_counts[p] == 0 for p in range(engine.pool.num_pages))  # published pages: free
    assert engine.cache.storage.free_states == engine.cache.spec.max_states


def test_a_rewound_chain_resumes_from_its_last_checkpoint(model):
    """A hybrid chain cannot be cut back (its state exists only at its end), so a rewind drops its table; its
    published pages and checkpoints remain, and the next turn starts at the last checkpoint within the kept
    history instead of recomputing it all."""
    from tests.chain_helpers import run_chain_turn

    llm, ref = _llm(model), _llm(model, enable_prefix_caching=False)
    rng = random.Random(4)
    first = random_tokens(rng, 50)  # chunks end at 16, 32, 48 (budget 18 on pages of 4): checkpoints there
    run_chain_turn(llm.engine, "c", first, PARAMS)
    llm.engine.rewind_chain("c", 40)
    again = first[:40] + random_tokens(rng, 6)
    out = run_chain_turn(llm.engine, "c", again, PARAMS)
    assert out.num_cached_tokens == 32 and out.num_prefilled_tokens == len(again) - 32
    expect = ref.generate([again], PARAMS)[0]
    assert out.token_ids == expect.token_ids and out.logprobs == pytest.approx(expect.logprobs, abs=1e-5)
