"""Eviction methods across the turns of a chain (Chain Cache), against a reference rebuilt from scratch.

Each case runs a 7-turn chain on a GQA tiny model (fp32, page size 4, chunked prefill of 16): a system
prompt, then turns adding 3 tokens (user text) or 12-40 random tokens (tool results); every turn's prompt is
the whole history plus the new tokens, so a turn resumes the chain's retained -- compacted -- KV and
prefills only its suffix.

The reference is a dense full-matrix forward (``dense_step`` of tests/policies/test_eviction_methods.py: our model
code, attention over the whole [T, T] matrix under a per-(layer, KV head) visibility mask) that replays the
engine's schedule over the whole multi-turn history: every query row sees the positions kept when its step
started plus the step's own earlier tokens, and after every step each method's per-turn rule (the policies'
module docstrings) is applied from its definition to the recorded q / k / attention, with python loops. Kept
positions after every step must equal ``cache.positions_of`` in the engine, the greedy tokens of every turn
must equal the reference's and ``greedy_with_mask`` under the reference's mask.
"""

import copy
import random
from collections import defaultdict

import pytest
import torch

from engine import SamplingParams
from tests.dense_reference import greedy_with_mask
from tests.chain_helpers import random_tokens, run_chain_turn
from tests.policies.test_eviction_methods import (
    PAGE,
    dense_step,
    make_llm,
    pool_reference,
    pyramid_reference,
    top_positions,
    window_vote,
)

CHUNK = 16
MAX_NEW = 4
NEW_LENS = (30, 3, 25, 3, 40, 3, 12)  # system prompt, then user turns (3 tokens) and tool results (12-40)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

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


# --- the methods' per-turn rules, from their definitions --------------------------------------------------
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


# --- the reference over the whole history -----------------------------------------------------------------
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


# --- running a chain in the engine ------------------------------------------------------------------------
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


# --- chain state: deep copies, lost state -------------------------------------------------------------------
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


def test_voted_selection_with_window_counts_that_differ_per_head():
    """A pruned chain can leave heads with different numbers of window slots: each head keeps its own window
    plus the top (budget - |window|) of its other slots by pooled vote."""
    from policies.scoring import keep_voted_and_window

    g = torch.Generator().manual_seed(0)
    vote = torch.rand(3, 10, generator=g)
    pos = torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 10],
                        [0, 2, 3, 4, 5, 6, 8, 9, 10, 11]])
    got = keep_voted_and_window(vote, pos, 9, 6, 3, "max")
    for h in range(3):
        row = pos[h].tolist()
        win = [i for i, p in enumerate(row) if p >= 9]
        others = list(range(len(row) - len(win)))
        pooled = pool_reference(vote[h, : len(others)].tolist(), 3, "max")
        assert got[h].tolist() == top_positions(others, dict(zip(others, pooled)), 6 - len(win)) + win


def test_query_stash_rolls_keeps_a_pending_window_and_replaces_a_cut_back_history():
    from policies.scoring import QueryStash

    def rows(first, n):  # row i holds its position
        return torch.arange(first, first + n, dtype=torch.float32)[:, None, None].expand(n, 2, 3)

    def held(stash):
        q, pos = stash.rows_between(0, 0, 10**6)
        assert torch.equal(q[:, 0, 0].long(), pos)
        return pos.tolist()

    st = QueryStash(1, 4)
    st.push(0, rows(0, 6), 0)
    assert held(st) == [2, 3, 4, 5]
    st.push(0, rows(6, 1), 6)
    assert held(st) == [3, 4, 5, 6]
    st.push(0, rows(7, 2), 7, keep_from=4)  # the window [4, ...) waits: nothing at >= 4 is dropped
    assert held(st) == [4, 5, 6, 7, 8]
    st.push(0, rows(9, 1), 9)
    assert held(st) == [6, 7, 8, 9]
    st.push(0, rows(8, 1), 8)  # a history cut back to 8: the old row 9 is gone
    assert held(st) == [6, 7, 8] and st.rows_between(0, 7, 9)[1].tolist() == [7, 8]
    st.push(0, rows(20, 1), 20)  # a gap: older rows are dropped
    assert held(st) == [20]
    loaded = QueryStash.load(copy.deepcopy(st.export()), 4)
    assert held(loaded) == [20]
