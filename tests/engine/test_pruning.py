"""Prefix-cache pruning of a chain: exact page accounting, resume after pruning, attention skips pruned KV."""

import random

import pytest
import torch

import policies.knorm  # noqa: F401  (registers "knorm")
from engine import SamplingParams
from engine.errors import ConfigError, InvalidRequestError
from tests.chain_helpers import kept_positions, run_chain_turn
from tests.dense_reference import greedy_with_mask, pruned_visibility

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def turn(engine, chain_id, prompt):
    return run_chain_turn(engine, chain_id, prompt, PARAMS)


@pytest.mark.parametrize("arch,scorer,keep_ratio,keep_tokens", [
    ("qwen3", "knorm", 0.2, None), ("qwen3", None, 0.0, None), ("qwen3", "knorm", 0.0, 13), ("qwen3", None, 0.0, 0),
    ("glm4_moe_lite", "knorm", 0.2, None), ("deepseek_v3", "knorm", 0.0, 13),
])
def test_pruning_frees_exact_pages_and_the_next_turn_resumes_without_the_pruned_kv(make_llm, arch, scorer,
                                                                                  keep_ratio, keep_tokens):
    llm = make_llm(arch, page_size=PAGE)
    engine, rng = llm.engine, random.Random(0)
    system, tool, user = ([rng.randrange(3, 500) for _ in range(n)] for n in (20, 40, 6))
    prompt = system + tool + user
    history = prompt + turn(engine, "c", prompt).token_ids
    computed = len(history) - 1
    before = engine.chain_info("c")
    assert before.pages_held == -(-computed // PAGE)

    result = engine.prune_chain("c", [(20, 60)], scorer=scorer, keep_ratio=keep_ratio, keep_tokens=keep_tokens)
    dropped = round((1 - keep_ratio) * 40) if keep_tokens is None else 40 - keep_tokens
    assert result.tokens_freed == dropped and result.tokens_kept == computed - dropped
    assert result.pages_freed == before.pages_held - (-(-(computed - dropped) // PAGE))
    after = engine.chain_info("c")
    assert after.pages_held == before.pages_held - result.pages_freed
    assert after.logical_tokens == before.logical_tokens and after.compacted
    kept = kept_positions(engine, "c")
    for layer_positions in kept:
        inside = ((layer_positions >= 20) & (layer_positions < 60)).sum(1)
        assert inside.tolist() == [40 - dropped] * layer_positions.shape[0]

    new = [rng.randrange(3, 500) for _ in range(7)]
    out = turn(engine, "c", history + new)
    assert out.resume_status == "resumed" and out.num_resumed_tokens == computed
    assert out.num_prefilled_tokens == len(new) + 1
    expected = greedy_with_mask(engine.model, history + new, 5, pruned_visibility(kept, computed))
    assert out.token_ids == expected

    engine.delete_chain("c")
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_keep_tokens_keeps_what_the_equal_keep_ratio_keeps(make_llm):
    """keep_tokens = k over an interval of n keeps the same slots as keep_ratio = k / n (one scorer ranking)."""
    kept = []
    for kw in ({"keep_ratio": 0.25}, {"keep_tokens": 10}):
        llm = make_llm("qwen3", page_size=PAGE)
        engine, rng = llm.engine, random.Random(5)
        prompt = [rng.randrange(3, 500) for _ in range(70)]
        turn(engine, "c", prompt)
        engine.prune_chain("c", [(10, 30), (40, 60)], scorer="knorm", **kw)
        kept.append(kept_positions(engine, "c"))
    for a, b in zip(*kept):
        assert torch.equal(a, b)


def test_prune_rejects_bad_input_and_leaves_the_chain_unchanged(make_llm):
    llm = make_llm("qwen3", page_size=PAGE)
    engine = llm.engine
    prompt = list(range(10, 40))
    turn(engine, "c", prompt)
    info = engine.chain_info("c")
    for intervals, ratio, scorer, err, words in [
        ([(5, 500)], 0.0, None, InvalidRequestError, "interval"),
        ([(-1, 4)], 0.0, None, InvalidRequestError, "interval"),
        ([(8, 8)], 0.0, None, InvalidRequestError, "interval"),
        ([(4, 8)], 1.5, None, InvalidRequestError, "keep_ratio"),
        ([(4, 8)], 0.5, None, InvalidRequestError, "scorer"),
        ([(4, 8)], 0.5, "nope", ConfigError, "unknown scorer"),
    ]:
        with pytest.raises(err, match=words):
            engine.prune_chain("c", intervals, scorer=scorer, keep_ratio=ratio)
    for kw, words in [({"keep_tokens": -1}, "keep_tokens"), ({"keep_tokens": 2.5}, "keep_tokens"),
                      ({"keep_tokens": 2, "keep_ratio": 0.5, "scorer": "knorm"}, "not both"),
                      ({"keep_tokens": 2}, "scorer")]:
        with pytest.raises(InvalidRequestError, match=words):
            engine.prune_chain("c", [(4, 8)], **kw)
    assert engine.chain_info("c") == info
