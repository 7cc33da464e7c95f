"""A chain turn that meets a full pool keeps its chain's KV in the host tier instead of losing it: a turn whose
offloaded chain has no room on the device when it is queued stays parked and loads when admitted; a queued turn
holding its chain's KV that must give it up to a running request moves it down (``ChainMemory.park``); an
aborted parked turn leaves the chain in the tier. Reference: the same turn on an engine whose chain never left
the device (tokens equal, logprobs within fp32 noise of a different batch composition)."""

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.chain_helpers import finish, random_tokens, run_chain_turn

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
OTHER = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def engine(model_dir, num_pages, **options):
    return LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=PAGE, num_pages=num_pages,
                                  max_num_batched_tokens=64, **options))


@pytest.fixture
def setup(tiny_dirs):
    """An engine with a 40-page pool and a host tier, its chain "a" (a 76-token history, 19 pages) and the
    next turn's prompt; and the reference engine with the same history."""
    rng = random.Random(3)
    first = random_tokens(rng, 72)
    eng = engine(tiny_dirs["qwen3"], 40, chain_host_bytes=64 * 2**20)
    ref = engine(tiny_dirs["qwen3"], 400)
    out, out_ref = run_chain_turn(eng, "a", first, PARAMS), run_chain_turn(ref, "a", first, PARAMS)
    assert out.token_ids == out_ref.token_ids
    prompt = first + out.token_ids + random_tokens(rng, 10)
    other = random_tokens(rng, 120)  # a stateless request that needs 31 of the 40 pages
    return eng, ref, prompt, other


def check_equal(out, ref):
    assert out.token_ids == ref.token_ids
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert out.num_prefilled_tokens == ref.num_prefilled_tokens


def test_a_turn_whose_offloaded_chain_has_no_room_waits_parked_and_loads_when_admitted(setup):
    eng, ref, prompt, other = setup
    eng.chains.memory.reclaim(eng.pool.num_pages)
    assert eng.chain_info("a").status == "host"
    eng.add_request(other, OTHER)
    eng.step()
    eng.step()  # the stateless request's whole prompt is in the pool: 9 pages free, the chain needs 20
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    assert eng._requests[rid].parked  # not dropped at the turn's arrival: it waits for room
    out = finish(eng, rid)
    assert out.resume_status == "loaded", "the turn recomputed its chain instead of loading it"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))
    assert eng.chains.tiers.counters.loads["host"] == 1


def test_a_queued_turn_gives_its_chain_kv_to_the_host_tier_when_a_running_request_needs_the_pages(setup):
    eng, ref, prompt, other = setup
    eng.add_request(other, OTHER)  # admitted first; its second chunk finds only 1 free page
    rid = eng.add_request(prompt, PARAMS, chain_id="a")  # queued behind it, holding the chain's 20 pages
    out = finish(eng, rid)
    counters = eng.chains.tiers.counters
    assert counters.offloaded_tokens > 0 and counters.loads["host"] == 1
    assert out.resume_status == "loaded", "the queued turn's chain KV was freed and recomputed"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))


def test_an_aborted_parked_turn_leaves_its_chain_in_the_host_tier_for_the_next_turn(setup):
    eng, ref, prompt, other = setup
    other_id = eng.add_request(other, OTHER)
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    eng.step()
    eng.step()  # the running request took the queued turn's pages: the turn is parked
    assert eng._requests[rid].parked
    eng.abort(rid)
    assert eng.chain_info("a").status == "host"
    finish(eng, other_id)
    out = run_chain_turn(eng, "a", prompt, PARAMS)
    assert out.resume_status == "loaded", "the abort dropped the chain the parked turn had given back"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))
