"""snapkv_global and kvzip_global pruning scorers against references over the full attention matrix, and
deferred prunes of busy chains (applied when the turn ends, equal to pruning the idle chain)."""

import random

import pytest
import torch

import policies.kvzip_global  # noqa: F401  (registers the scorers)
import policies.snapkv_global
from engine import LLM, SamplingParams
from engine.chain_index import ChainBusyError
from policies.kvzip import DEFAULT_REPEAT_PROMPT
from tests.chain_helpers import kept_positions, random_tokens, run_chain_turn
from tests.dense_reference import RecordingRunner, greedy_with_mask, pruned_visibility

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
INTERVAL, KEEP = (4, 30), 0.25


def make_engine(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16).engine


def dense_probs(model, seq):
    """[layer] -> [Hq, T, T] causal attention probabilities of ``seq``."""
    heads = model.config.num_kv_heads
    runner = RecordingRunner(lambda layer, T: torch.ones(T, T, dtype=torch.bool).tril().expand(heads, T, T))
    with torch.no_grad():
        model(torch.tensor(seq), torch.arange(len(seq)), runner)
    return runner.probs


def snapkv_global_reference(model, history, heads, window=32, kernel=7):
    """score[pos] for pos < n - window: the window rows' attention, averaged over rows and each KV head's
    query heads, max-pooled over positions (kernel 7), then averaged over layers and KV heads."""
    n = len(history)
    start = n - window
    probs = dense_probs(model, history)
    total = [0.0] * start
    for layer, p in probs.items():
        group = p.shape[0] // heads
        for h in range(heads):
            vote = [float(p[h * group:(h + 1) * group, start:n, s].mean()) for s in range(start)]
            for s in range(start):
                lo, hi = max(0, s - kernel // 2), min(start, s + kernel // 2 + 1)
                total[s] += max(vote[lo:hi])
    return [t / (len(probs) * heads) for t in total]


def kvzip_global_reference(model, history, heads, repeat_ids, chunk):
    """score[pos]: max over reconstruction chunks, their rows, query heads, layers and KV heads of the attention
    on pos while [history + repeat prompt + chunk] is computed causally."""
    n = len(history)
    score = [0.0] * n
    for lo in range(0, n, chunk):
        probs = dense_probs(model, history + repeat_ids + history[lo: lo + chunk])
        for p in probs.values():
            for s in range(n):
                score[s] = max(score[s], float(p[:, n:, s].max()))
    return score


def expected_kept(score, n, heads, num_layers):
    lo, hi = INTERVAL
    num_drop = round((1 - KEEP) * (hi - lo))
    dropped = set(sorted(range(lo, hi), key=lambda s: (score[s], s))[:num_drop])
    row = [s for s in range(n) if s not in dropped]
    return [[row] * heads for _ in range(num_layers)]


def chain_with_history(engine, rng, n_prompt=60):
    prompt = random_tokens(rng, n_prompt)
    out = run_chain_turn(engine, "c", prompt, PARAMS)
    return prompt + out.token_ids


@pytest.mark.parametrize("arch,scorer", [("qwen3", "snapkv_global"), ("qwen3", "kvzip_global"),
                                         ("glm4_moe_lite", "snapkv_global"), ("deepseek_v3", "kvzip_global")])
def test_scorer_keeps_the_reference_positions_in_every_layer_and_head(tiny_dirs, monkeypatch, arch, scorer):
    monkeypatch.setattr(policies.kvzip_global.KVzipGlobalScorer, "chunk_size", 24)  # 3 reconstruction chunks
    engine = make_engine(tiny_dirs[arch])
    mc = engine.model_config
    rng = random.Random(11)
    tokens = chain_with_history(engine, rng)
    n = len(tokens) - 1  # the last sampled token has no KV yet
    result = engine.prune_chain("c", [INTERVAL], scorer=scorer, keep_ratio=KEEP)
    assert result.status == "applied" and result.tokens_freed == round((1 - KEEP) * (INTERVAL[1] - INTERVAL[0]))
    if scorer == "snapkv_global":
        score = snapkv_global_reference(engine.model, tokens[:n], mc.num_kv_heads) + [float("inf")] * 32
    else:
        repeat_ids = engine.tokenizer.encode(DEFAULT_REPEAT_PROMPT, add_special_tokens=False)
        score = kvzip_global_reference(engine.model, tokens[:n], mc.num_kv_heads, repeat_ids, 24)
    kept = kept_positions(engine, "c")
    assert [k.tolist() for k in kept] == expected_kept(score, n, mc.num_kv_heads, mc.num_layers)

    new = random_tokens(rng, 6)
    out = run_chain_turn(engine, "c", tokens + new, PARAMS)
    assert out.resume_status == "resumed" and out.num_resumed_tokens == n
    assert out.token_ids == greedy_with_mask(engine.model, tokens + new, 5, pruned_visibility(kept, n))


def test_a_prune_of_a_busy_chain_is_deferred_and_equals_pruning_it_idle(tiny_dirs):
    model_dir = tiny_dirs["qwen3"]
    busy, idle = make_engine(model_dir), make_engine(model_dir)
    history = chain_with_history(busy, random.Random(2))
    assert chain_with_history(idle, random.Random(2)) == history
    turn2 = history + random_tokens(random.Random(3), 9)

    rid = busy.add_request(turn2, PARAMS, chain_id="c")
    busy.step()
    with pytest.raises(ChainBusyError):
        busy.prune_chain("c", [INTERVAL], scorer="snapkv_global", keep_ratio=KEEP, defer=False)
    queued = busy.prune_chain("c", [INTERVAL], scorer="snapkv_global", keep_ratio=KEEP)
    bad = busy.prune_chain("c", [(0, 10_000)])  # checked when it applies: beyond the chain's KV
    assert queued.status == "deferred" and queued.tokens_freed == 0
    assert busy.prune_result(queued.prune_id).status == "deferred"
    assert not busy.chain_info("c").compacted
    final = None
    while busy.has_unfinished():
        for o in busy.step():
            if o.request_id == rid and o.finished:
                final = o
    applied = busy.prune_result(queued.prune_id)
    assert applied.status == "applied" and applied.tokens_freed > 0
    failed = busy.prune_result(bad.prune_id)
    assert failed.status == "failed" and "interval" in failed.error

    assert run_chain_turn(idle, "c", turn2, PARAMS).token_ids == final.token_ids
    direct = idle.prune_chain("c", [INTERVAL], scorer="snapkv_global", keep_ratio=KEEP)
    assert (direct.tokens_kept, direct.tokens_freed, direct.pages_freed) == (
        applied.tokens_kept, applied.tokens_freed, applied.pages_freed)
    assert [k.tolist() for k in kept_positions(busy, "c")] == [k.tolist() for k in kept_positions(idle, "c")]
    assert busy.chain_info("c") == idle.chain_info("c")


def test_deferred_prune_outcomes_are_kept_for_the_last_ones_only(monkeypatch):
    """A long-lived engine keeps the outcomes of the last MAX_PRUNE_RESULTS prunes, and every one still deferred."""
    from engine import chain_prune
    from engine.chain_prune import ChainPruner, PruneResult

    monkeypatch.setattr(chain_prune, "MAX_PRUNE_RESULTS", 3)
    pruner = ChainPruner(cache=None, num_layers=1, load=None)
    statuses = ["applied", "deferred", "failed", "applied", "deferred", "applied"]
    pruner.results = {i: PruneResult(0, 0, 0, status=s, prune_id=i) for i, s in enumerate(statuses)}
    pruner.apply_deferred(type("State", (), {"chain_id": "none"})())  # nothing queued: only the bound runs
    assert list(pruner.results) == [1, 4, 5]
