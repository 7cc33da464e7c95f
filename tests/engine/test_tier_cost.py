"""Load a chain from disk or recompute it (engine.tier_cost): the rule on exact numbers, the rates it reads, and an
engine whose turn recomputes a chain on a disk measured slow (its file removed, its tokens those of a chain that
never left the device) and loads it from a disk measured fast."""

import logging
import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tier_cost import MARGIN, Rate, TierRates, recompute_instead
from tests.chain_helpers import random_tokens, run_chain_turn

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)


# --- the rule -------------------------------------------------------------------------------------------------
def test_the_rule_recomputes_only_when_the_read_is_slower_by_more_than_the_margin():
    # 1500 bytes at 100 B/s: 15 s to read; 1000 tokens at 100 tokens/s: 10 s to recompute; 15 == 1.5 x 10
    assert MARGIN == 1.5
    assert not recompute_instead(1500, 1000, 100.0, 100.0)  # the boundary loads
    assert recompute_instead(1501, 1000, 100.0, 100.0)  # one byte more recomputes
    assert not recompute_instead(1500, 1001, 100.0, 100.0)  # one token more loads
    assert recompute_instead(1500, 1000, 100.0, 99.0) is False  # 15 s vs 1.5 x 10.1 s
    assert recompute_instead(1500, 1000, 99.0, 100.0) is True  # 15.15 s vs 15 s
    assert recompute_instead(1500, 1000, 100.0, 100.0, margin=1.49) is True
    assert recompute_instead(1000, 1000, 100.0, 100.0, margin=1.0) is False  # equal costs: load


def test_the_measured_numbers_recompute_a_full_chain_on_a_slow_disk_and_load_a_compacted_one():
    """The H200 machine's numbers (docs/benchmarks.md, chain resume at 32K): 4 GiB read in 6.836 s, 32K tokens
    recomputed in 1.283 s; a compacted chain of 4096 kept tokens has 8x fewer bytes and the same history."""
    gib4, tokens = 4 * 2**30, 32768
    read_rate, prefill_rate = gib4 / 6.836, tokens / 1.283
    assert recompute_instead(gib4, tokens, read_rate, prefill_rate)
    assert not recompute_instead(gib4 // 8, tokens, read_rate, prefill_rate)
    assert not recompute_instead(gib4, tokens, 5e9, prefill_rate)  # NVMe


@pytest.mark.parametrize("read_rate, prefill_rate", [(None, 100.0), (100.0, None), (None, None), (0.0, 100.0),
                                                     (100.0, 0.0), (-1.0, 100.0), (100.0, -1.0)])
def test_an_unknown_rate_loads(read_rate, prefill_rate):
    assert not recompute_instead(10**12, 1, read_rate, prefill_rate)


def test_a_rate_is_the_ratio_of_decayed_sums():
    rate = Rate(decay=0.5)
    assert rate.per_second is None
    rate.observe(100, 0)  # nothing measured
    rate.observe(0, 1.0)
    assert rate.per_second is None
    rate.observe(100, 1.0)
    assert rate.per_second == 100.0
    rate.observe(300, 1.0)  # (0.5 * 100 + 300) / (0.5 * 1 + 1)
    assert rate.per_second == pytest.approx(350 / 1.5)
    rate.observe(10, 1.0)  # (0.5 * 350 + 10) / (0.5 * 1.5 + 1)
    assert rate.per_second == pytest.approx(185 / 1.75)


def test_tier_rates_apply_the_rule_to_what_they_measured():
    rates = TierRates()
    assert not rates.recompute_instead(1501, 1000)  # nothing measured: load
    rates.disk_read.observe(100, 1.0)
    assert not rates.recompute_instead(1501, 1000)  # the prefill rate unknown: load
    rates.prefill.observe(100, 1.0)
    assert rates.recompute_instead(1501, 1000) and not rates.recompute_instead(1500, 1000)


# --- an engine ------------------------------------------------------------------------------------------------
def engine(model_dir, **options):
    return LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=4, num_pages=400,
                                  max_num_batched_tokens=64, **options))


def to_disk(eng, chain_id):
    """Move an idle chain's KV to a written file in the disk tier, as pressure does."""
    state = eng.chains.index.get(chain_id)
    assert eng.release_chain(chain_id) and eng.chain_info(chain_id).status == "host"
    assert eng.chains.tiers.persist_entry(state.offloaded) and eng.chain_info(chain_id).status == "disk"
    return state.offloaded.path


@pytest.fixture
def engines(tiny_dirs, tmp_path):
    model_dir = tiny_dirs["qwen3"]
    eng = engine(model_dir, chain_host_bytes=64 * 2**20, chain_disk_dir=str(tmp_path), chain_disk_bytes=64 * 2**20)
    return eng, engine(model_dir)


def next_turn(eng, ref, rng):
    """A turn of chain ``c`` on both engines, the chain on ``eng`` sent to disk first; returns ``eng``'s output
    and the chain's file, after checking its tokens equal the reference's (whose chain never left the device)."""
    path = to_disk(eng, "c")
    prompt = eng.chains.index.get("c").token_ids + random_tokens(rng, 6)
    out, out_ref = run_chain_turn(eng, "c", prompt, PARAMS), run_chain_turn(ref, "c", prompt, PARAMS)
    assert out_ref.resume_status == "resumed"
    assert out.token_ids == out_ref.token_ids and out.finished
    return out, path


def test_a_turn_recomputes_a_chain_on_a_disk_measured_slow_and_loads_it_from_one_measured_fast(engines, caplog):
    eng, ref = engines
    tiers = eng.chains.tiers
    rng = random.Random(7)
    history = random_tokens(rng, 40)
    for e in (eng, ref):
        run_chain_turn(e, "c", history, PARAMS)
    # the engine measured its prefill (the scheduler's steps), not yet the disk: the first disk turn loads
    assert tiers.rates.prefill.per_second > 0 and tiers.counters.prefill_tokens_per_s > 0
    assert tiers.rates.disk_read.per_second is None and tiers.counters.disk_read_bytes_per_s == 0.0
    out, path = next_turn(eng, ref, rng)
    assert out.resume_status == "loaded" and not path.exists()
    assert tiers.counters.loads["disk"] == 1 and tiers.rates.disk_read.per_second > 0
    assert tiers.counters.disk_read_bytes_per_s == tiers.rates.disk_read.per_second

    # a slow disk: what one byte per second of reads would have measured
    tiers.rates.disk_read = Rate(decay=0.5, amount=1.0, seconds=1.0)
    with caplog.at_level(logging.INFO, logger="engine.chain_tiers"):
        out, path = next_turn(eng, ref, rng)
    assert out.resume_status == "recomputed" and out.num_resumed_tokens == 0
    assert not path.exists() and tiers.disk_used == 0
    assert tiers.counters.recomputed_by_cost == 1 and tiers.counters.loads["disk"] == 1
    assert "instead of reading its file from disk" in caplog.text

    # a fast disk: loaded again (and measured: the rate moves off the slow one)
    tiers.rates.disk_read = Rate(decay=0.5, amount=1e15, seconds=1.0)
    out, path = next_turn(eng, ref, rng)
    assert out.resume_status == "loaded" and out.num_resumed_tokens > 0 and not path.exists()
    assert tiers.counters.recomputed_by_cost == 1 and tiers.counters.loads["disk"] == 2


def test_a_chain_on_a_slow_disk_still_loads_for_a_fork_a_rewind_a_prefetch_or_with_the_rule_off(engines):
    eng, _ = engines
    tiers = eng.chains.tiers
    rng = random.Random(8)
    history = random_tokens(rng, 40)
    run_chain_turn(eng, "c", history, PARAMS)
    tiers.rates.disk_read = Rate(decay=0.5, amount=1.0, seconds=1.0)
    tiers.rates.prefill = Rate(decay=0.9, amount=1e6, seconds=1.0)
    to_disk(eng, "c")
    eng.fork_chain("c", "f")  # needs the KV itself: loaded
    assert eng.chain_info("c").status == "idle" and eng.chain_info("f").status == "idle"
    to_disk(eng, "c")
    eng.rewind_chain("c", 30)
    assert eng.chain_info("c").status == "idle" and eng.chains.index.get("c").num_computed == 30
    to_disk(eng, "c")
    assert eng.prefetch_chain("c")
    to_disk(eng, "c")
    tiers.cost_aware = False  # a benchmark timing disk loads
    out = run_chain_turn(eng, "c", eng.chains.index.get("c").token_ids + random_tokens(rng, 6), PARAMS)
    assert out.resume_status == "loaded" and tiers.counters.recomputed_by_cost == 0
    assert tiers.counters.loads["disk"] == 4
