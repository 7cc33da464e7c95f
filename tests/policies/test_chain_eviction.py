"""Eviction methods across the turns of a chain (Chain Cache), against a reference rebuilt from scratch.

Each case runs a 7-turn chain on a GQA tiny model (fp32, page size 4, chunked prefill of 16): a system
prompt, then turns adding 3 tokens (user text) or 12-40 random tokens (tool results); every turn's prompt is
the whole history plus the new tokens, so a turn resumes the chain's retained -- compacted -- KV and
prefills only its suffix.

The reference is ``tests/chain_eviction_reference.py``'s (its module docstring says how): kept positions after
every step must equal ``cache.positions_of`` in the engine, the greedy tokens of every turn must equal the
reference's and ``greedy_with_mask`` under the reference's mask.
"""

import random

import pytest
import torch

from tests.chain_eviction_reference import (
    MAX_NEW,
    NEW_LENS,
    PARAMS,
    check_chain_against_reference,
    record_steps,
    run_chain,
    run_turn,
)
from tests.chain_helpers import random_tokens
from tests.eviction_reference import make_llm

CHUNK = 16

SNAP = dict(budget=24, window=6, kernel_size=3)  # window 6 > a 3-token turn's suffix of 4: it reaches back
CASES = {
    "dense": ("dense", {}, "qwen3"),
    "streaming_llm": ("streaming_llm", dict(sink_tokens=4, window=20, slack=4), "qwen3"),
    "snapkv": ("snapkv", SNAP, "qwen3"),
    "snapkv-reeval-avg": ("snapkv", dict(SNAP, pooling="avg", reeval_every=2), "llama"),
    "pyramidkv": ("pyramidkv", dict(SNAP, beta=4), "qwen3"),
    "h2o": ("h2o", dict(heavy_budget=12, recent_budget=12), "qwen3"),
    "h2o-every-3": ("h2o", dict(heavy_budget=10, recent_budget=8, evict_every=3), "llama"),
    # hybrids: the methods act on the full-attention layers; the linear layers' state is resumed, and the
    # reference recomputes it from the first token at every step
    "dense-hybrid": ("dense", {}, "qwen3_next"),
    "snapkv-hybrid": ("snapkv", SNAP, "qwen3_5"),
    "h2o-hybrid": ("h2o", dict(heavy_budget=12, recent_budget=12), "qwen3_5_moe"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chain_turns_match_a_reference_rebuilt_from_scratch(case, tiny_dirs):
    method, cfg, arch = CASES[case]
    llm = make_llm(tiny_dirs[arch], method, cfg, chunk=CHUNK)
    turns, steps = run_chain(llm, seed=len(case))
    info = llm.engine.chain_info("c")
    assert info.compacted == (method != "dense")
    if method in ("snapkv", "pyramidkv"):  # some turn's window reached back into the previous turn
        assert any(len(new) + 1 < cfg["window"] and len(prompt) > cfg["budget"] for prompt, new, _, _ in turns)
    check_chain_against_reference(llm, method, cfg, turns, steps)


@pytest.mark.parametrize("case", ["dense", "streaming_llm", "snapkv", "h2o"])
def test_a_chain_pruned_between_turns_still_matches(case, tiny_dirs):
    """``prune_chain`` compacts an idle chain behind the method's back: sinks (positions 1-2) and the last two
    positions -- part of the next turn's SnapKV window -- are dropped; H2O re-aligns its scores by position."""
    method, cfg, arch = CASES[case]
    llm = make_llm(tiny_dirs[arch], method, cfg, chunk=CHUNK)
    computed_before_5 = sum(NEW_LENS[:5]) + 5 * MAX_NEW - 1
    prune = {5: [(1, 3), (computed_before_5 - 2, computed_before_5)]}
    turns, steps = run_chain(llm, seed=7, prune_before=prune)
    check_chain_against_reference(llm, method, cfg, turns, steps, prune_before=prune)


# --- chain state: deep copies, lost state ---------------------------------------------------------------------
@pytest.mark.parametrize("case", ["snapkv", "pyramidkv", "h2o"])
def test_forked_chains_carry_independent_method_state(case, tiny_dirs):
    method, cfg, arch = CASES[case]
    llm = make_llm(tiny_dirs[arch], method, cfg, chunk=CHUNK)
    engine, rng = llm.engine, random.Random(11)
    steps = record_steps(engine)
    history = []
    for k in (30, 12, 3):
        prompt = history + random_tokens(rng, k)
        history = prompt + run_turn(engine, "c", prompt).token_ids
    engine.fork_chain("c", "f")
    assert engine.chains.index.get("f").method_state is not engine.chains.index.get("c").method_state
    prompt = history + random_tokens(rng, 3)
    out_c, kept_c = run_turn(engine, "c", prompt), steps[-1][2]
    out_f, kept_f = run_turn(engine, "f", prompt), steps[-1][2]
    assert out_f.resume_status == "resumed" and out_f.token_ids == out_c.token_ids
    assert all(torch.equal(a, b) for a, b in zip(kept_c, kept_f))
    for cid in ("c", "f"):
        engine.delete_chain(cid)
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("case", ["snapkv", "h2o"])
def test_an_aborted_turn_gives_the_chain_back_its_kv_and_method_state(case, tiny_dirs):
    """An aborted turn restores the chain's (uncompacted) KV and the method state it had before the turn; the
    next turn resumes from both."""
    method, cfg, arch = CASES[case]
    llm = make_llm(tiny_dirs[arch], method, cfg, chunk=CHUNK)
    engine, rng = llm.engine, random.Random(12)
    prompt = random_tokens(rng, 18)  # under every budget: never compacted, so it survives the abort
    history = prompt + run_turn(engine, "c", prompt).token_ids
    before = engine.chains.index.get("c").method_state
    assert before is not None
    rid = engine.add_request(history + random_tokens(rng, 20), PARAMS, chain_id="c")
    engine.abort(rid)  # before any step: a turn that compacted its KV could not give it back
    assert engine.chains.index.get("c").method_state is before
    prompt = history + random_tokens(rng, 3)  # 25 tokens > 24: evicts; the SnapKV window [19, 25) reaches back
    out = run_turn(engine, "c", prompt)
    # H2O: the 3 new tokens + the last generated one; SnapKV recomputes its whole window (uncompacted KV)
    assert out.resume_status == "resumed" and out.num_prefilled_tokens == (4 if method == "h2o" else SNAP["window"])
    kept = 24 if method == "h2o" else 24 + MAX_NEW - 1  # H2O evicts after every token, SnapKV once
    assert engine.chain_info("c").physical_tokens == [kept] * 2
    engine.delete_chain("c")
    assert engine.pool.num_free == engine.pool.num_pages
