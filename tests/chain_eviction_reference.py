"""The eviction methods across the turns of a chain (Chain Cache): a reference rebuilt from scratch, and the
chain runs it is compared with (tests/policies/test_chain_eviction.py).

The reference is a dense full-matrix forward (``dense_step`` of tests/eviction_reference.py: our model
code, attention over the whole [T, T] matrix under a per-(layer, KV head) visibility mask) that replays the
engine's schedule over the whole multi-turn history: every query row sees the positions kept when its step
started plus the step's own earlier tokens, and after every step each method's per-turn rule (the policies'
module docstrings) is applied from its definition to the recorded q / k / attention, with python loops. Kept
positions after every step must equal ``cache.positions_of`` in the engine, the greedy tokens of every turn
must equal the reference's and ``greedy_with_mask`` under the reference's mask.
"""

import random
from collections import defaultdict

import torch

from engine import SamplingParams
from tests.dense_reference import greedy_with_mask
from tests.chain_helpers import random_tokens, run_chain_turn
from tests.eviction_reference import (
    PAGE,
    dense_step,
    pool_reference,
    pyramid_reference,
    top_positions,
    window_vote,
)

MAX_NEW = 4
NEW_LENS = (30, 3, 25, 3, 40, 3, 12)  # system prompt, then user turns (3 tokens) and tool results (12-40)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


# --- the methods' per-turn rules, from their definitions ------------------------------------------------------
# rule(rec, s, e, kept, P): after a step that computed logical positions [s, e) of a turn whose prompt has P
# tokens; kept[layer][head] is the sorted list of held positions (the step's tokens already appended).
def dense_rule():
    return lambda rec, s, e, kept, P: None


def streaming_chain_rule(sink, window, slack):
    def rule(rec, s, e, kept, P):
        for layer in kept:
            for h, row in enumerate(layer):
                if len(row) > sink + window + slack:
                    sinks = [p for p in row if p < sink]
                    layer[h] = sinks + row[len(row) - (sink + window - len(sinks)):]
    return rule


def snap_chain_rule(budget, window, kernel, pooling, budgets_of, reeval_every=0):
    """SnapKV / PyramidKV per turn: at the end of the turn's prompt, the queries of positions [P - w, P) vote over
    every held position; each (layer, head) over its budget keeps its window positions plus the top others."""

    def trim(rec, kept, lo, hi, budgets, queries_from=None):
        for layer, b in enumerate(budgets):
            for h, row in enumerate(kept[layer]):
                if len(row) <= b:
                    continue
                win = [p for p in row if p >= lo]
                others = [p for p in row if p < lo]
                vote = window_vote(rec, layer, h, range(max(lo, queries_from or lo), hi), row)[: len(others)]
                score = dict(zip(others, pool_reference(vote, kernel, pooling)))
                kept[layer][h] = top_positions(others, score, b - len(win)) + win

    def rule(rec, s, e, kept, P):
        if s < P <= e:  # this step finished the turn's prompt (e == P)
            if P > budget:  # the window's queries are those the engine still holds (rule.queries_from)
                trim(rec, kept, P - window, P, budgets_of(P), rule.queries_from)
        elif reeval_every and e > P and (e - P) % reeval_every == 0:
            trim(rec, kept, e - window, e, budgets_of(P))
    rule.window, rule.stashes_decode, rule.queries_from = window, bool(reeval_every), None
    return rule


def h2o_chain_rule(heavy, recent, evict_every):
    """H2O with one score per (layer, head, position) for the whole chain: every query adds the attention it
    paid; after each prompt step of a turn, and every ``evict_every`` generated tokens of it, a row over
    budget keeps its ``recent`` latest positions plus the ``heavy`` others of largest score."""
    acc = defaultdict(float)

    def rule(rec, s, e, kept, P):
        for layer, rows in enumerate(kept):
            probs = rec.probs[layer].double()
            group = probs.shape[0] // len(rows)
            for h, row in enumerate(rows):
                received = probs[h * group:(h + 1) * group, s:e].sum(dim=(0, 1))
                for p in row:
                    acc[layer, h, p] += float(received[p])
        if s >= P and (not evict_every or (e - P) % evict_every):
            return
        for layer, rows in enumerate(kept):
            for h, row in enumerate(rows):
                if len(row) > heavy + recent:
                    cut = len(row) - recent
                    rows[h] = top_positions(row[:cut], {p: acc[layer, h, p] for p in row[:cut]}, heavy) + row[cut:]
    return rule


def make_rule(method, cfg, num_layers):
    if method == "dense":
        return dense_rule()
    if method == "streaming_llm":
        return streaming_chain_rule(cfg["sink_tokens"], cfg["window"], cfg["slack"])
    if method == "h2o":
        return h2o_chain_rule(cfg["heavy_budget"], cfg["recent_budget"], cfg.get("evict_every", 1))
    budget, window = cfg["budget"], cfg["window"]
    if method == "pyramidkv":
        def budgets_of(P):
            return pyramid_reference(budget, window, cfg["beta"], num_layers, P)
    else:
        def budgets_of(P):
            return [budget] * num_layers
    return snap_chain_rule(budget, window, cfg["kernel_size"], cfg.get("pooling", "max"), budgets_of,
                           cfg.get("reeval_every", 0))


# --- the reference over the whole history ---------------------------------------------------------------------
@torch.no_grad()
def simulate_chain(model, turns, rule, num_layers, heads, prune_before=None):
    """Replay a chain: ``turns`` is a list of (new tokens, steps, first position computed) with the engine's
    step sizes; the history is rebuilt from scratch with a dense forward per step under the kept sets. A turn
    that starts before the end of the computed history recomputes the positions from there (the engine cut
    them back: SnapKV's window). ``prune_before`` maps a turn index to the intervals ``prune_chain`` dropped
    (keep_ratio 0) before it. Returns (tokens per turn, kept after every step, mask)."""
    N = sum(len(new) for new, _, _ in turns) + MAX_NEW * len(turns)
    mask = [torch.zeros(heads, N, N, dtype=torch.bool) for _ in range(num_layers)]
    kept = [[[] for _ in range(heads)] for _ in range(num_layers)]
    ids, s, outputs, history = [], 0, [], []
    stash = None  # (lo, hi): logical positions of the query rows a SnapKV request holds between turns
    for t, (new, steps, start) in enumerate(turns):
        for lo, hi in (prune_before or {}).get(t, []):
            prune_reference(kept, lo, hi)
        ids += new
        P, tokens = len(ids), []
        assert start <= s
        if start < s:  # recomputed: the retained positions >= start are dropped and computed again
            for layer in kept:
                for h, row in enumerate(layer):
                    layer[h] = [p for p in row if p < start]
            for m in mask:
                m[:, start:s, :] = False
            s = start
        w = getattr(rule, "window", None)
        if w is not None:  # the stash takes this turn's rows from ``start``, joined to what it held if adjacent
            lo = start if stash is None or stash[1] < start else min(stash[0], start)
            rule.queries_from = max(P - w, lo)
        for n in steps:
            e = s + n
            rec, token = dense_step(model, ids, s, e, mask, kept)
            if token is not None:
                tokens.append(token)
                ids.append(token)
            rule(rec, s, e, kept, P)
            history.append([[list(row) for row in layer] for layer in kept])
            s = e
        if w is not None:  # decode rows are stashed only under re-evaluation; the last w rows are kept
            hi = s if rule.stashes_decode else P
            stash = (max(lo, hi - w), hi)
        outputs.append(tokens)
    return outputs, history, mask


def prune_reference(kept, lo, hi):
    """``ChainManager.prune`` with one interval, no scorer and keep_ratio 0: each layer drops, from every head,
    as many positions inside [lo, hi) as its head with the fewest holds (the latest ones first)."""
    for layer in kept:
        inside = [[p for p in row if lo <= p < hi] for row in layer]
        k = min(len(x) for x in inside)
        for h, row in enumerate(layer):
            drop = set(inside[h][len(inside[h]) - k:]) if k else set()
            layer[h] = [p for p in row if p not in drop]


# --- running a chain in the engine ----------------------------------------------------------------------------
def record_steps(engine):
    """After every step: (request id, tokens computed, kept positions per layer) of each request of the step."""
    method, cache = engine.method, engine.cache
    num_layers = engine.cache.spec.num_layers  # layers with KV (a hybrid's full-attention layers)
    steps = []
    inner = method.end_step

    def end_step(batch):
        inner(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            steps.append((req.request_id, n, [cache.positions_of(req, layer).clone() for layer in range(num_layers)]))

    method.end_step = end_step
    return steps


def run_turn(engine, chain_id, prompt):
    return run_chain_turn(engine, chain_id, prompt, PARAMS)


def run_chain(llm, seed, prune_before=None):
    """Run the chain turn by turn, checking the per-turn counters; returns [(prompt, new, steps, out)], steps."""
    engine, rng = llm.engine, random.Random(seed)
    steps = record_steps(engine)
    history, turns = [], []
    for t, k in enumerate(NEW_LENS):
        for lo, hi in (prune_before or {}).get(t, []):
            engine.prune_chain("c", [(lo, hi)])
        new = random_tokens(rng, k)
        prompt = history + new
        first = len(steps)
        table = engine.chains.index.get("c").table if t else None
        floor = table.compacted_at if table is not None and table.is_compacted else 0  # (read before the turn)
        out = run_turn(engine, "c", prompt)
        assert len(out.token_ids) == MAX_NEW
        if t == 0:
            assert out.resume_status == "created" and out.num_prefilled_tokens == len(prompt)
        else:  # (a) only the new tokens and the previous turn's last generated token (it had no KV yet) -- or,
            # for a method computing each prompt's last ``window`` tokens, back to the window's start as far as
            # the retained KV can be cut (only tokens appended since its last compaction)
            assert out.resume_status == "resumed"
            resumed = len(history) - 1
            window = engine.method.config.window if engine.method.name in ("snapkv", "pyramidkv") else 0
            if window and engine.cache.storage.cuts_tables:  # a hybrid's state resumes only whole
                resumed = min(resumed, max(len(prompt) - window, floor))
            assert out.num_prefilled_tokens == len(prompt) - resumed
            assert out.num_resumed_tokens == resumed
        assert all(rid == out.request_id for rid, _, _ in steps[first:])
        # (c) the chain holds exactly the pages its longest layer needs
        info = engine.chain_info("c")
        assert info.status == "idle" and info.computed_tokens == len(prompt) + MAX_NEW - 1
        assert info.physical_tokens == [k.shape[1] for k in steps[-1][2]]
        assert info.pages_held == -(-max(info.physical_tokens) // PAGE)
        turns.append((prompt, new, [n for _, n, _ in steps[first:]], out))
        history = prompt + out.token_ids
    return turns, steps


def check_chain_against_reference(llm, method, cfg, turns, steps, prune_before=None):
    engine = llm.engine
    model, mc = engine.model, engine.model_config
    num_layers = engine.cache.spec.num_layers
    rule = make_rule(method, cfg, num_layers)
    turns_ref = [(new, n, len(prompt) - out.num_prefilled_tokens) for prompt, new, n, out in turns]
    ref_tokens, ref_kept, mask = simulate_chain(model, turns_ref, rule, num_layers, mc.num_kv_heads,
                                                prune_before)
    # (b) the kept positions after every step, and the tokens of every turn
    assert len(ref_kept) == len(steps)
    for i, ((_, _, got), want) in enumerate(zip(steps, ref_kept)):
        for layer, (g, w) in enumerate(zip(got, want)):
            assert g.tolist() == w, f"step {i}, layer {layer}"
    for t, ((prompt, _, _, out), tokens) in enumerate(zip(turns, ref_tokens)):
        assert out.token_ids == tokens, f"turn {t}"
        assert out.token_ids == greedy_with_mask(model, prompt, MAX_NEW, lambda layer, T: mask[layer][:, :T, :T])
    # (d) nothing leaks once the chain is gone
    engine.delete_chain("c")
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
