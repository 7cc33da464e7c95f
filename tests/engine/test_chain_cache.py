"""Chain Cache: resume from retained KV, reclaim under memory pressure, fork, rewind, abort.

The reference for every output is a fresh engine (no chains, no prefix cache) run on the same full token
history; counters are exact."""

import random

import pytest

from engine import SamplingParams
from engine.chain_index import ChainBusyError, UnknownChainError
from engine.errors import InvalidRequestError
from tests.chain_helpers import random_tokens, run_chain_turn

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def references(make_llm):
    """A fresh engine per architecture (made on first use): prompt -> its greedy tokens."""
    engines = {}

    def reference_of(arch):
        if arch not in engines:
            engines[arch] = make_llm(arch, enable_prefix_caching=False)
        return lambda prompt: engines[arch].generate([prompt], PARAMS)[0].token_ids
    return reference_of


@pytest.fixture(scope="module")
def reference(references):
    return references("qwen3")


def turn(engine, chain_id, prompt):
    return run_chain_turn(engine, chain_id, prompt, PARAMS)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_each_turn_prefills_only_its_new_tokens_and_matches_a_fresh_run(make_llm, references, arch):
    reference = references(arch)
    llm = make_llm(arch, page_size=PAGE, max_num_batched_tokens=16)
    engine, rng = llm.engine, random.Random(0)
    history = random_tokens(rng, 30)  # system prompt
    for i in range(7):
        new = random_tokens(rng, rng.choice([3, 9, 40]))  # user text or a tool result
        prompt = history + new
        out = turn(engine, "c1", prompt)
        assert out.token_ids == reference(prompt)
        if i == 0:
            assert out.resume_status == "created" and out.num_prefilled_tokens == len(prompt)
        else:
            assert out.resume_status == "resumed"
            assert out.num_resumed_tokens == len(history) - 1  # the last generated token had no KV yet
            assert out.num_prefilled_tokens == len(new) + 1
        history = prompt + out.token_ids
        info = engine.chain_info("c1")
        assert info.logical_tokens == len(history) and info.computed_tokens == len(history) - 1
        assert info.pages_held == -(-(len(history) - 1) // PAGE) and info.status == "idle"
    engine.delete_chain("c1")
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_more_chains_than_memory_reclaims_lru_and_recomputes(make_llm, reference):
    llm = make_llm("qwen3", page_size=PAGE, num_pages=40, max_num_batched_tokens=32)
    engine, rng = llm.engine, random.Random(1)
    histories = {f"c{i}": random_tokens(rng, 20) for i in range(6)}
    statuses = []
    order = list(histories)
    for _ in range(3):
        order.reverse()  # the most recently used chains are still resident, the oldest were reclaimed
        for cid in order:
            prompt = histories[cid] + random_tokens(rng, 6)
            out = turn(engine, cid, prompt)
            assert out.token_ids == reference(prompt)
            statuses.append(out.resume_status)
            histories[cid] = prompt + out.token_ids
    assert "recomputed" in statuses and "resumed" in statuses
    assert sum(engine.chains.index.get(c).num_reclaims for c in histories) > 0
    for cid in histories:
        engine.delete_chain(cid)
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_concurrent_chain_turns_batch_together_under_pressure(make_llm, reference):
    llm = make_llm("qwen3", page_size=PAGE, num_pages=30, max_num_batched_tokens=24)
    engine, rng = llm.engine, random.Random(2)
    histories = {f"c{i}": random_tokens(rng, 15) for i in range(4)}
    for _ in range(3):
        prompts = {cid: h + random_tokens(rng, 5) for cid, h in histories.items()}
        ids = {engine.add_request(p, PARAMS, chain_id=cid): cid for cid, p in prompts.items()}
        finals = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    finals[ids[o.request_id]] = o
        for cid, prompt in prompts.items():
            assert finals[cid].token_ids == reference(prompt)
            histories[cid] = prompt + finals[cid].token_ids


@pytest.mark.parametrize("arch", ["qwen3", "glm4_moe_lite"])
def test_fork_and_rewind_equal_building_the_history_from_scratch(make_llm, references, arch):
    reference = references(arch)
    llm = make_llm(arch, page_size=PAGE)
    engine, rng = llm.engine, random.Random(3)
    p1 = random_tokens(rng, 22)
    h = p1 + turn(engine, "a", p1).token_ids
    engine.fork_chain("a", "b")
    pa, pb = h + random_tokens(rng, 7), h + random_tokens(rng, 5)
    out_a, out_b = turn(engine, "a", pa), turn(engine, "b", pb)
    assert out_a.token_ids == reference(pa) and out_b.token_ids == reference(pb)
    assert out_b.resume_status == "resumed" and out_b.num_resumed_tokens == len(h) - 1
    pa2 = pa + out_a.token_ids + random_tokens(rng, 3)  # a's KV must be intact after b appended to the fork
    assert turn(engine, "a", pa2).token_ids == reference(pa2)

    engine.rewind_chain("a", len(p1) - 3)
    assert engine.chain_info("a").logical_tokens == len(p1) - 3
    pr = p1[:-3] + random_tokens(rng, 6)
    out = turn(engine, "a", pr)
    assert out.token_ids == reference(pr)
    assert out.resume_status == "resumed" and out.num_resumed_tokens == len(p1) - 3
    with pytest.raises(InvalidRequestError, match="num_tokens"):
        engine.rewind_chain("a", 10**6)
    for cid in ("a", "b"):
        engine.delete_chain(cid)
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_diverging_turn_resumes_from_the_common_prefix(make_llm, reference):
    llm = make_llm("qwen3", page_size=PAGE)
    engine, rng = llm.engine, random.Random(4)
    p1 = random_tokens(rng, 25)
    turn(engine, "d", p1)
    p2 = p1[:13] + random_tokens(rng, 8)  # an edited history
    out = turn(engine, "d", p2)
    assert out.token_ids == reference(p2)
    assert out.resume_status == "resumed" and out.num_resumed_tokens == 13


def test_busy_chain_and_abort_leave_the_chain_as_it_was(make_llm, reference):
    llm = make_llm("qwen3", page_size=PAGE)
    engine, rng = llm.engine, random.Random(5)
    p1 = random_tokens(rng, 18)
    h = p1 + turn(engine, "e", p1).token_ids
    before = engine.chain_info("e")
    rid = engine.add_request(h + random_tokens(rng, 30), SamplingParams(temperature=0.0, max_tokens=50),
                             chain_id="e")
    with pytest.raises(ChainBusyError):
        engine.add_request(h + [7], PARAMS, chain_id="e")
    with pytest.raises(ChainBusyError):
        engine.delete_chain("e")
    engine.step()
    engine.step()
    engine.abort(rid)
    after = engine.chain_info("e")
    assert (after.logical_tokens, after.computed_tokens, after.pages_held) == (
        before.logical_tokens, before.computed_tokens, before.pages_held)
    p2 = h + random_tokens(rng, 4)
    out = turn(engine, "e", p2)
    assert out.token_ids == reference(p2) and out.resume_status == "resumed"
    with pytest.raises(UnknownChainError):
        engine.chain_info("nope")
