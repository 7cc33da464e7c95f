"""R-KV eviction against a reference written from its paper's definition.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule applied from its definition; kept positions, greedy tokens and masked greedy tokens must agree.
"""

import math

import pytest
import torch

import policies.rkv  # noqa: F401
from tests.eviction_reference import (
    check_against_reference,
    make_llm,
    make_prompts,
    params,
    pool_reference,
    run_recorded,
    top_positions,
)


def softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [x / total for x in exps]


# --- references from the papers' definitions ----------------------------------------------------------------
def rkv_rule(P, budget, buffer, alpha, mix_lambda=0.1, kernel=7, threshold=0.5, gqa_pooling="max"):
    """From the prompt's end on, a layer holding >= budget + buffer positions: each KV head keeps the last
    ``alpha`` (the observation window) plus the budget - alpha older positions of largest
    ``mix_lambda * importance - (1 - mix_lambda) * redundancy`` (see policies/rkv.py for the definition)."""

    def rule(rec, s, e, kept):
        if e < P:
            return
        for layer, rows in enumerate(kept):
            if len(rows[0]) < budget + buffer:
                continue
            q, k = rec.q[layer].double(), rec.k[layer].double()
            hq, d = q.shape[1], q.shape[2]
            group = hq // k.shape[1]
            for h, row in enumerate(rows):
                window, older = row[-alpha:], row[:-alpha]
                assert window == list(range(e - alpha, e))
                # importance: per observation query, group-pooled logits, softmax over the older keys
                imp = [0.0] * len(older)
                for i in window:
                    z = []
                    for p in older:
                        logits = [float(q[i, j] @ k[p, h]) / math.sqrt(d) for j in range(h * group, (h + 1) * group)]
                        z.append(max(logits) if gqa_pooling == "max" else sum(logits) / group)
                    for x, a in enumerate(softmax(z)):
                        imp[x] += a / alpha
                imp = pool_reference(imp, kernel, "max")
                # redundancy: cosine similarity among all the head's keys
                n = len(row)
                unit = torch.stack([k[p, h] / (torch.linalg.vector_norm(k[p, h]) + 1e-8) for p in row])
                sim = (unit @ unit.T).tolist()
                for a in range(n):
                    sim[a][a] = 0.0
                for a in range(n):
                    similar = [b for b in range(n) if sim[a][b] > threshold]
                    sim[a][max(similar) if similar else 0] = 0.0
                red = softmax([sum(sim[a][b] for a in range(n)) / n for b in range(n)])
                score = {p: mix_lambda * imp[x] - (1 - mix_lambda) * red[x] for x, p in enumerate(older)}
                rows[h] = top_positions(older, score, budget - alpha) + window
    return rule


# --- R-KV -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,cfg", [
    ("qwen3", dict(budget=16, buffer=8, alpha=4, kernel_size=3)),
    ("llama", dict(budget=14, buffer=6, alpha=3, kernel_size=7, mix_lambda=0.5, threshold=0.3, gqa_pooling="mean")),
    ("deepseek_v3", dict(budget=16, buffer=8, alpha=4, kernel_size=3)),
])
def test_rkv_matches_reference(arch, cfg, tiny_dirs):
    max_new = 36
    prompts = make_prompts((9, 30, 50), seed=9)  # 50 >= budget + buffer: compressed right after the prompt
    llm = make_llm(tiny_dirs[arch], "rkv", cfg)
    outs, history = run_recorded(llm, prompts, max_new)
    limit = cfg["budget"] + cfg["buffer"]
    for out in outs:
        P, done, compressions = len(out.prompt_token_ids), 0, 0
        for n, kept in history[out.request_id]:
            done += n
            lens = [k.shape[1] for k in kept]
            if done >= P:
                assert max(lens) < limit
                compressions += lens == [cfg["budget"]] * 2
        assert compressions >= 2  # every request was compressed more than once
    ref = dict(budget=cfg["budget"], buffer=cfg["buffer"], alpha=cfg["alpha"], kernel=cfg["kernel_size"],
               mix_lambda=cfg.get("mix_lambda", 0.1), threshold=cfg.get("threshold", 0.5),
               gqa_pooling=cfg.get("gqa_pooling", "max"))
    check_against_reference(llm, prompts, outs, history, lambda P: rkv_rule(P, **ref), max_new)


def test_rkv_bounds_long_decodes_and_its_freed_pages_are_reused(tiny_dirs):
    """Two concurrent 300-token decodes (budget 32 + buffer 16, prompts 20 and 27) in an 82-page pool (328 slots,
    the least that admits the longer one): densely they would need 162 pages at once; under R-KV each holds < 48
    slots per layer after every step (asserted each step), exactly ceil(slots / 4) pages, every compression hands
    back exactly 4 pages (12 -> 8), both run to the end without preemption, and the pool hands out more pages
    than it has, every page handed out a second time having been freed by a compression. Kept positions and
    tokens match the dense reference throughout."""
    budget, buffer, alpha, max_new, num_pages = 32, 16, 8, 300, 82
    llm = make_llm(tiny_dirs["qwen3"], "rkv", dict(budget=budget, buffer=buffer, alpha=alpha), num_pages=num_pages)
    engine, cache, pool = llm.engine, llm.engine.cache, llm.engine.pool
    prompts = make_prompts((20, 27), seed=10)
    allocated, freed, compressions = [], [], {}
    inner_allocate, inner_end_step = pool.allocate, engine.method.end_step

    def allocate(n):
        pages = inner_allocate(n)
        allocated.extend(pages)
        return pages

    def end_step(batch):
        before = {r.request_id: list(cache.table(r).pages) for r in batch.requests}
        inner_end_step(batch)
        held = 0
        for req in batch.requests:
            pages = cache.table(req).pages
            lens = [cache.physical_len(req, layer) for layer in range(2)]
            assert max(lens) <= budget + buffer - 1  # never budget + buffer or more between steps
            assert len(pages) == -(-max(lens) // 4)
            if len(pages) < len(before[req.request_id]):  # a compression
                assert lens == [budget, budget] and len(before[req.request_id]) == 12 and len(pages) == 8
                assert pages == before[req.request_id][:8]
                freed.extend(before[req.request_id][8:])
                compressions[req.request_id] = compressions.get(req.request_id, 0) + 1
            held += len(pages)
        assert pool.num_free == num_pages - held  # exact accounting: nothing else holds a page

    pool.allocate, engine.method.end_step = allocate, end_step
    outs, history = run_recorded(llm, prompts, max_new)
    assert [len(o.token_ids) for o in outs] == [max_new] * 2 and engine.scheduler.num_preemptions == 0
    for out in outs:  # every `buffer` tokens once the budget filled
        P = len(out.prompt_token_ids)
        assert compressions[out.request_id] == (P + max_new - 1 - (budget + buffer)) // buffer + 1
    assert len(freed) == 4 * sum(compressions.values())
    assert len(allocated) > num_pages  # so pages were handed out again ...
    seen, again = set(), []
    for page in allocated:
        if page in seen:
            again.append(page)
        seen.add(page)
    assert again and set(again) <= set(freed)  # ... and each of those came back from a compression
    assert pool.num_free == num_pages
    check_against_reference(llm, prompts, outs, history,
                            lambda P: rkv_rule(P, budget, buffer, alpha, kernel=7), max_new)


def test_rkv_prefix_reuse_never_covers_the_observation_window(tiny_dirs):
    """An uncompressed 36-token run publishes 9 pages; a 40-token prompt extending it would reuse 36 tokens,
    but the prompt's last alpha = 8 queries must be computed, so it reuses 32 and then compresses exactly as a
    cold run does."""
    cfg = dict(budget=40, buffer=8, alpha=8)
    prompt = make_prompts((40,), seed=12)[0]
    cold, cold_history = run_recorded(make_llm(tiny_dirs["llama"], "rkv", cfg), [prompt], 12)
    llm = make_llm(tiny_dirs["llama"], "rkv", cfg)
    llm.generate([prompt[:36]], params(2))  # 37 slots < budget + buffer: never compressed, pages stay published
    warm, warm_history = run_recorded(llm, [prompt], 12)
    assert cold[0].num_cached_tokens == 0 and warm[0].num_cached_tokens == 32
    kept_cold, kept_warm = cold_history[cold[0].request_id][-1][1], warm_history[warm[0].request_id][-1][1]
    assert [k.shape[1] for k in kept_warm] == [40 + 3, 40 + 3]  # compressed at 48 slots, 3 decoded since
    assert all(torch.equal(x, y) for x, y in zip(kept_cold, kept_warm))
    assert warm[0].token_ids == cold[0].token_ids



def test_rkv_redundancy_in_row_chunks_equals_the_whole_matrix():
    """The chunked redundancy equals step 3 over the whole [Hkv, n, n] similarity, written out here."""
    from policies.rkv import redundancy

    torch.manual_seed(0)
    keys = torch.randn(53, 2, 16)
    keys[40] = keys[7] * 3  # a repeated direction: similarity 1 with an earlier key
    k = keys.transpose(0, 1)
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(1, 2)
    sim.diagonal(dim1=1, dim2=2).zero_()
    for h in range(2):
        for s in range(53):
            similar = [t for t in range(53) if sim[h, s, t] > 0.5]
            sim[h, s, max(similar, default=0)] = 0.0
    ref = torch.softmax(sim.mean(dim=1), dim=-1)
    for max_elements in (2**26, 2 * 53 * 5, 1):  # one chunk, chunks of 5 rows, one row at a time
        torch.testing.assert_close(redundancy(keys, 0.5, max_elements), ref, atol=1e-6, rtol=1e-5)
