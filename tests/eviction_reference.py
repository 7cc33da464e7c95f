"""The dense replay reference of the eviction methods, and the engine runs it is compared with: StreamingLLM,
SnapKV, PyramidKV and H2O (tests/policies/test_streaming_llm.py, test_snapkv.py, test_pyramidkv.py, test_h2o.py),
TOVA, Knorm and R-KV (test_tova.py, test_knorm.py, test_rkv.py), what they share (test_eviction_shared*.py) and,
across the turns of a chain, tests/chain_eviction_reference.py.

The reference is a dense full-matrix forward (our model code, attention over the whole [T, T] matrix under a
per-(layer, KV head) visibility mask) that replays the engine's schedule step by step: every query row sees
the positions its request kept when the row's step started plus the step's own earlier tokens, the rows'
q / k / attention probabilities are recorded, and each method's rule is applied to them from its definition
(python loops over heads and positions, not the policies' tensor code). The schedule (how many tokens of
which request each step computed) is the only thing taken from the engine run; kept positions after every
step and the greedy tokens are compared, and the tokens are checked once more with ``greedy_with_mask``.
The rules shared by several methods are here (SnapKV's window vote and selection, also PyramidKV's; PyramidKV's
budgets); a rule of one method alone is in its test file.
"""

from collections import defaultdict
from fractions import Fraction

import torch

from engine import LLM, SamplingParams
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


# --- the dense reference --------------------------------------------------------------------------------------
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


# --- PyramidKV budgets ----------------------------------------------------------------------------------------
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
