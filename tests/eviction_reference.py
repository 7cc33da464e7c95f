"""Eviction methods (StreamingLLM, SnapKV, PyramidKV, H2O) against references written from the papers.

The reference is a dense full-matrix forward (our model code, attention over the whole [T, T] matrix under a
per-(layer, KV head) visibility mask) that replays the engine's schedule step by step: every query row sees
the positions its request kept when the row's step started plus the step's own earlier tokens, the rows'
q / k / attention probabilities are recorded, and each method's rule is applied to them from its definition
(python loops over heads and positions, not the policies' tensor code). The schedule (how many tokens of
which request each step computed) is the only thing taken from the engine run; kept positions after every
step and the greedy tokens are compared, and the tokens are checked once more with ``greedy_with_mask``.
"""

from collections import defaultdict
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

import policies.h2o  # noqa: F401  (registers the methods)
import policies.pyramidkv
import policies.snapkv  # noqa: F401
import policies.streaming_llm  # noqa: F401
from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.registry import create_method
from tests.dense_reference import from_scratch, greedy_with_mask

PAGE = 4
MAX_NEW = 8
PROMPT_LENS = (9, 40, 70)


def make_prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def params(max_new=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)


def make_llm(model_dir, method="dense", cfg=None, chunk=16, num_pages=256, **kw):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=chunk,
               num_pages=num_pages, method=method, method_config=cfg or {}, **kw)


def run_recorded(llm, prompts, max_new=MAX_NEW):
    """Generate, recording after every step each request's (num_new_tokens, kept positions per layer)."""
    method, cache = llm.engine.method, llm.engine.cache
    num_layers = llm.engine.model_config.num_layers
    history = defaultdict(list)
    inner = method.end_step

    def end_step(batch):
        inner(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            history[req.request_id].append((n, [cache.positions_of(req, layer).clone() for layer in range(num_layers)]))

    method.end_step = end_step
    outs = llm.generate(prompts, params(max_new))
    return outs, history


# --- the dense reference ----------------------------------------------------------------------------------
class RecordingRunner:
    """Full-matrix attention under mask[layer] ([Hkv, N, N] bool, causality included); records q, k, probs."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, mask):
        self.mask = mask
        self.q, self.k, self.probs = {}, {}, {}

    def attention(self, layer, q, k, v):
        T, hq, d = q.shape
        group = hq // k.shape[1]
        visible = self.mask[layer][:, :T, :T].repeat_interleave(group, dim=0)
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * d**-0.5
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        self.q[layer], self.k[layer], self.probs[layer] = q.float(), k.float(), probs
        return torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1)).to(q.dtype)

    def end_layer(self, layer, hidden):
        pass


@torch.no_grad()
def dense_step(model, ids, s, e, mask, kept):
    """One reference step over positions [s, e): each new row sees the kept slots and the step's own causal
    span; the step's tokens join every kept set. Returns (the recorder, the next greedy token or None)."""
    for layer, heads in zip(mask, kept):
        for h, row in enumerate(heads):
            for i in range(s, e):
                layer[h, i, row] = True
                layer[h, i, s:i + 1] = True
    rec = from_scratch(RecordingRunner(mask), model, e)
    hidden = model(torch.tensor(ids[:e]), torch.arange(e), rec)
    token = int(model.compute_logits(hidden[e - 1:e]).argmax(-1)) if e == len(ids) else None
    for heads in kept:
        for h in range(len(heads)):
            heads[h] = heads[h] + list(range(s, e))
    return rec, token


@torch.no_grad()
def simulate(model, prompt, steps, rule, max_new, num_layers, heads):
    """Replay ``steps`` (tokens computed per step) densely; ``rule(rec, s, e, kept)`` edits ``kept[layer][head]``
    (sorted lists of positions) after each step. Returns (tokens, kept after each step, the visibility mask)."""
    P = len(prompt)
    N = P + max_new
    mask = [torch.zeros(heads, N, N, dtype=torch.bool) for _ in range(num_layers)]
    kept = [[[] for _ in range(heads)] for _ in range(num_layers)]
    ids, s, history = list(prompt), 0, []
    for n in steps:
        e = s + n
        rec, token = dense_step(model, ids, s, e, mask, kept)
        if token is not None:
            ids.append(token)
        rule(rec, s, e, kept)
        history.append([[list(row) for row in layer] for layer in kept])
        s = e
    return ids[P:], history, mask


def top_positions(candidates, score, k):
    """The k candidates of largest score (ties to the earlier position), in position order."""
    return sorted(sorted(candidates, key=lambda p: (-score[p], p))[:k])


def pool_reference(values, kernel, pooling):
    r, n = kernel // 2, len(values)
    out = []
    for j in range(n):
        cells = values[max(0, j - r): j + r + 1]
        out.append(max(cells) if pooling == "max" else sum(cells) / kernel)
    return out


def window_vote(rec, layer, h, query_positions, key_positions):
    """SnapKV's vote from its definition: per window query and query head of KV head h, softmax over the
    given keys (causal by position), summed over the queries, averaged over the group's query heads."""
    q, k = rec.q[layer].double(), rec.k[layer].double()
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    keys = k[key_positions, h]  # [n, D]
    kpos = torch.tensor(key_positions)
    total = torch.zeros(len(key_positions), dtype=torch.float64)
    for j in range(h * group, (h + 1) * group):
        for qp in query_positions:
            logits = (keys @ q[qp, j]) / d**0.5
            logits[kpos > qp] = float("-inf")
            total += torch.softmax(logits, dim=0)
    return (total / group).tolist()


def streaming_rule(sink, window, slack):
    def rule(rec, s, e, kept):
        for layer in kept:
            for h, row in enumerate(layer):
                if len(row) > sink + window + slack:
                    layer[h] = row[:sink] + row[-window:]
    return rule


def snap_rule(P, budgets, window, kernel, pooling, reeval_every=0, budget=None):
    done = {"prompt": False}

    def select(rec, layer, h, row, query_positions, b):
        win = [p for p in row if p >= query_positions[0]]
        assert win == list(query_positions)
        prefix = [p for p in row if p < query_positions[0]]
        vote = window_vote(rec, layer, h, query_positions, row)[: len(prefix)]
        pooled = pool_reference(vote, kernel, pooling)
        score = dict(zip(prefix, pooled))
        return top_positions(prefix, score, b - window) + win

    def rule(rec, s, e, kept):
        if not done["prompt"]:
            if e < P:
                return
            done["prompt"] = True
            if P <= budget:
                return
            for layer, b in enumerate(budgets):
                if b >= P:
                    continue
                for h in range(len(kept[layer])):
                    row = kept[layer][h]
                    assert row == list(range(e))
                    prompt_part = select(rec, layer, h, list(range(P)), range(P - window, P), b)
                    kept[layer][h] = prompt_part + list(range(P, e))
        elif reeval_every and e > P and (e - P) % reeval_every == 0:
            for layer, b in enumerate(budgets):
                for h in range(len(kept[layer])):
                    if len(kept[layer][h]) > b:
                        kept[layer][h] = select(rec, layer, h, kept[layer][h], range(e - window, e), b)
    return rule


def h2o_rule(P, heavy, recent, evict_every):
    acc = defaultdict(float)  # (layer, head, position) -> accumulated attention

    def rule(rec, s, e, kept):
        for layer, rows in enumerate(kept):
            probs = rec.probs[layer].double()
            group = probs.shape[0] // len(rows)
            for h, row in enumerate(rows):
                received = probs[h * group:(h + 1) * group, s:e].sum(dim=(0, 1))
                for p in row:
                    acc[layer, h, p] += float(received[p])
        prefill = s < P
        for layer, rows in enumerate(kept):
            for h, row in enumerate(rows):
                if len(row) <= heavy + recent:
                    continue
                if not prefill and (not evict_every or (e - P) % evict_every):
                    continue
                cut = len(row) - recent
                score = {p: acc[layer, h, p] for p in row[:cut]}
                rows[h] = top_positions(row[:cut], score, heavy) + row[cut:]
    return rule


def check_against_reference(llm, prompts, outs, history, make_rule, max_new=MAX_NEW):
    model = llm.engine.model
    mc = llm.engine.model_config
    for out, prompt in zip(outs, prompts):
        steps = [n for n, _ in history[out.request_id]]
        tokens, ref_kept, mask = simulate(model, prompt, steps, make_rule(len(prompt)), max_new,
                                          mc.num_layers, mc.num_kv_heads)
        assert len(ref_kept) == len(history[out.request_id])
        for step, ((_, engine_kept), ref) in enumerate(zip(history[out.request_id], ref_kept)):
            for layer, (got, want) in enumerate(zip(engine_kept, ref)):
                assert got.tolist() == want, f"prompt {len(prompt)}, step {step}, layer {layer}"
        assert out.token_ids == tokens
        assert out.token_ids == greedy_with_mask(model, prompt, max_new, lambda layer, T: mask[layer][:, :T, :T])
    assert all(r == 0 for r in llm.engine.pool.ref_counts)


# --- per-method tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "glm4_moe_lite"])
def test_streaming_llm_matches_reference(arch, tiny_dirs):
    cfg = dict(sink_tokens=2, window=12, slack=3)
    prompts = make_prompts(PROMPT_LENS)
    llm = make_llm(tiny_dirs[arch], "streaming_llm", cfg)
    outs, history = run_recorded(llm, prompts)
    assert max(h[-1][1][0].shape[1] for h in history.values()) <= 17
    check_against_reference(llm, prompts, outs, history, lambda P: streaming_rule(2, 12, 3))


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


def chunk_boundaries(outs, history):
    for out in outs:
        done = 0
        for n, _ in history[out.request_id]:
            done += n
            yield len(out.prompt_token_ids), done


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_pooling_matches_its_definition_at_the_edges(pooling, kernel):
    from policies.scoring import pool1d

    x = torch.rand(2, 11, generator=torch.Generator().manual_seed(kernel))
    got = pool1d(x, kernel, pooling)
    for h in range(2):
        torch.testing.assert_close(got[h], torch.tensor(pool_reference(x[h].tolist(), kernel, pooling)))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_pyramidkv_matches_reference(arch, tiny_dirs):
    cfg = dict(budget=20, window=4, beta=4, kernel_size=5)
    prompts = make_prompts((9, 30, 70), seed=2)
    llm = make_llm(tiny_dirs[arch], "pyramidkv", cfg)
    outs, history = run_recorded(llm, prompts)
    lens = {len(o.prompt_token_ids): [k.shape[1] for k in history[o.request_id][-1][1]] for o in outs}
    # B = 16: top = 16 // 4 = 4, bottom = 28 -> (32, 8); prompt 30 clamps the bottom to 26 -> (30, 10)
    assert lens == {9: [9 + MAX_NEW - 1] * 2, 30: [30 + MAX_NEW - 1, 10 + MAX_NEW - 1],
                    70: [32 + MAX_NEW - 1, 8 + MAX_NEW - 1]}

    def budgets(P):
        return pyramid_reference(20, 4, 4, 2, P)

    check_against_reference(llm, prompts, outs, history,
                            lambda P: snap_rule(P, budgets(P), 4, 5, "max", 0, budget=20))


@pytest.mark.parametrize("arch,evict_every", [("qwen3", 1), ("llama", 3), ("glm4_moe_lite", 1)])
def test_h2o_matches_reference(arch, evict_every, tiny_dirs):
    cfg = dict(heavy_budget=6, recent_budget=6, evict_every=evict_every)
    prompts = make_prompts(PROMPT_LENS, seed=3)
    llm = make_llm(tiny_dirs[arch], "h2o", cfg)
    outs, history = run_recorded(llm, prompts)
    check_against_reference(llm, prompts, outs, history, lambda P: h2o_rule(P, 6, 6, evict_every))
    # no prefix reuse under H2O (reused tokens would have no accumulated attention)
    again = llm.generate([prompts[2]], params(2))[0]
    assert again.num_cached_tokens == 0


# --- PyramidKV budgets ------------------------------------------------------------------------------------
def pyramid_reference(budget, window, beta, m, P):
    mean = budget - window
    top, bottom = mean // beta, 2 * mean - mean // beta
    if P > budget and P - window < bottom:
        bottom, top = P - window, 2 * mean - (P - window)
    if m == 1:
        return [budget]
    real = [Fraction(bottom) - Fraction(bottom - top, m - 1) * layer for layer in range(m)]
    ints = [int(x) for x in real]  # floor (all non-negative)
    for layer in sorted(range(m), key=lambda i: (-(real[i] - ints[i]), i))[: m * mean - sum(ints)]:
        ints[layer] += 1
    return [window + b for b in ints]


def test_pyramid_budgets_follow_the_formula():
    from policies.pyramidkv import pyramid_budgets

    # B = 90, top = 90 // 20 = 4, bottom = 176; 176, 118.67, 61.33, 4 -> the one leftover unit goes to layer 1
    assert pyramid_budgets(100, 10, 20, 4, 10_000) == [186, 129, 71, 14]
    # prompt 150: prefix 140 < 176 clamps the bottom to 140 and raises the top to 40
    assert pyramid_budgets(100, 10, 20, 4, 150) == [150, 117, 83, 50]
    assert pyramid_budgets(100, 10, 1, 4, 10_000) == [100] * 4
    assert pyramid_budgets(100, 10, 20, 1, 10_000) == [100]
    for m in (2, 3, 7, 32):
        for budget, window, beta in ((2048, 32, 20), (100, 10, 3), (64, 63, 20)):
            for P in (budget + 1, budget + 50, 10 * budget):
                got = pyramid_budgets(budget, window, beta, m, P)
                assert got == pyramid_reference(budget, window, beta, m, P)
                assert sum(got) == m * budget
                assert all(a >= b for a, b in zip(got, got[1:])) and got[-1] >= window


# --- dense when the budget covers the prompt ----------------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [
    ("streaming_llm", dict(sink_tokens=4, window=74, slack=0)),
    ("snapkv", dict(budget=70, window=8)),
    ("pyramidkv", dict(budget=70, window=8)),
    ("h2o", dict(heavy_budget=40, recent_budget=37)),
])
def test_budget_covering_the_sequence_reproduces_dense(method, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=4)
    dense = make_llm(tiny_dirs["qwen3"]).generate(prompts, params())
    llm = make_llm(tiny_dirs["qwen3"], method, cfg)
    outs, history = run_recorded(llm, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for out in outs:  # nothing was ever evicted
        for _, kept in history[out.request_id]:
            assert all(torch.equal(k, torch.arange(k.shape[1]).expand_as(k)) for k in kept)


# --- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("streaming_llm", {"window": 0}),
    ("streaming_llm", {"sink_tokens": -1}),
    ("streaming_llm", {"slack": 1.5}),
    ("streaming_llm", {"windw": 4}),
    ("snapkv", {"window": 0}),
    ("snapkv", {"budget": 8, "window": 16}),
    ("snapkv", {"kernel_size": 4}),
    ("snapkv", {"pooling": "median"}),
    ("snapkv", {"reeval_every": -1}),
    ("snapkv", {"budget": True}),
    ("pyramidkv", {"beta": 0}),
    ("pyramidkv", {"kernel_size": 0}),
    ("h2o", {"heavy_budget": 0, "recent_budget": 0}),
    ("h2o", {"recent_budget": -2}),
    ("h2o", {"evict_every": -1}),
    ("h2o", {"budget": 10}),
])
def test_invalid_knobs_raise_config_error(method, options):
    with pytest.raises(ConfigError, match=method):
        create_method(method, options)


def test_methods_register_with_family_and_defaults():
    from engine.contract import Family

    for name in ("streaming_llm", "snapkv", "pyramidkv", "h2o"):
        m = create_method(name)
        assert m.family is Family.EVICTION and m.name == name
    assert create_method("snapkv").config == policies.snapkv.SnapKVConfig(2048, 32, 7, "max", 0)
    assert create_method("pyramidkv").config.beta == 20
    assert create_method("h2o").needs.received_attention
    # only StreamingLLM (end_step only) lets decode steps replay CUDA graphs whatever the request's state (here:
    # one still in its prompt; StreamingLLM reads the slots a request holds from its cache)
    in_prompt = SimpleNamespace(request_id="r", num_prompt_tokens=8, num_computed_tokens=0, num_preemptions=0)
    methods = [create_method(n) for n in ("streaming_llm", "snapkv", "pyramidkv", "h2o")]
    methods[0].bind(SimpleNamespace(table=lambda req: SimpleNamespace(num_slots=0)))
    assert [m.decode_capabilities(in_prompt).replay for m in methods] == \
        [True, False, False, False]


# --- memory -----------------------------------------------------------------------------------------------
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
