"""TOVA, Knorm and R-KV eviction against references written from their papers' definitions.

As in ``tests/test_eviction_methods.py`` (whose dense replay this file reuses): a dense full-matrix forward
replays the engine's schedule step by step under a per-(layer, KV head) visibility mask, records each row's
q / k / attention probabilities, and applies each method's rule to them from its definition (python loops
over heads and positions, not the policies' tensor code). Kept positions after every step, the greedy tokens,
and the tokens of ``greedy_with_mask`` under the replayed mask must all agree with the engine.
"""

import math
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

import policies.knorm_eviction
import policies.rkv
import policies.tova  # noqa: F401
from engine import LLM, SamplingParams
from engine.contract import Family
from engine.errors import ConfigError
from engine.registry import create_method
from tests.test_eviction_methods import (
    PROMPT_LENS,
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
def tova_rule(budget):
    """After every step, a layer holding more than ``budget`` positions keeps the ``budget`` of largest attention
    from the step's last query (the probabilities it actually used), averaged over all query heads; one set per
    layer for every KV head."""

    def rule(rec, s, e, kept):
        for layer, rows in enumerate(kept):
            row = rows[0]
            assert all(r == row for r in rows)
            if len(row) <= budget:
                continue
            probs = rec.probs[layer][:, e - 1].double()  # [Hq, T]: the newest token's attention
            hq = probs.shape[0]
            assert all(abs(float(probs[j, row].sum()) - 1) < 1e-5 for j in range(hq))  # it saw exactly `row`
            score = {p: sum(float(probs[j, p]) for j in range(hq)) / hq for p in row}
            chosen = top_positions(row, score, budget)
            for h in range(len(rows)):
                rows[h] = list(chosen)
    return rule


def top_positions_tied(candidates, score, k, engine_row=None, rtol=1e-6):
    """``top_positions``, except where scores within ``rtol`` of the k-th best straddle the cut: the norms
    are computed in fp32 by the engine and in fp64 here, so which of such near-equal positions is kept is
    below the engine's resolution, and the engine's choice (``engine_row``) is taken when it keeps every
    position that is clearly above the cut and the right number of the near-equal ones."""
    order = sorted(candidates, key=lambda p: (-score[p], p))
    if engine_row is None or len(order) <= k:
        return sorted(order[:k])
    cut = score[order[k - 1]]
    tol = rtol * abs(cut)
    sure = [p for p in candidates if score[p] > cut + tol]
    near = [p for p in candidates if abs(score[p] - cut) <= tol]
    if len(near) > k - len(sure) and set(sure) <= set(engine_row):
        chosen = [p for p in near if p in engine_row]
        if len(chosen) == k - len(sure):
            return sorted(sure + chosen)
    return sorted(order[:k])


def engine_kept_by_end(history, request_id):
    """The engine's kept positions after each step of a request, keyed by the tokens done by its end."""
    done, by_end = 0, {}
    for n, kept in history[request_id]:
        done += n
        by_end[done] = [rows.tolist() for rows in kept]
    return by_end


def knorm_rule(P, budget, recent=0, evict_every=0, slack=0, skip_layers=(), engine=None):
    """After the step completing the prompt (limit = budget) and every ``evict_every``-th decode token
    (limit = budget + slack): a (layer, KV head) holding more than the limit keeps its last ``recent`` positions
    plus the budget - recent others of smallest key L2 norm. ``engine`` (``engine_kept_by_end``) resolves
    near-ties at the cut (``top_positions_tied``)."""

    def rule(rec, s, e, kept):
        if s < P <= e:
            limit = budget
        elif s >= P and evict_every and (e - P) % evict_every == 0:
            limit = budget + slack
        else:
            return
        for layer, rows in enumerate(kept):
            if layer in skip_layers:
                continue
            k = rec.k[layer].double()
            for h, row in enumerate(rows):
                if len(row) <= limit:
                    continue
                cut = len(row) - recent
                score = {p: -float(torch.linalg.vector_norm(k[p, h])) for p in row[:cut]}
                engine_row = None if engine is None or e not in engine else engine[e][layer][h]
                rows[h] = top_positions_tied(row[:cut], score, budget - recent, engine_row) + row[cut:]
    return rule


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


def kept_lengths(history):
    """Per step, the physical length of each layer (after the step's eviction)."""
    return [[k.shape[1] for k in kept] for _, kept in history]


# --- TOVA -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_tova_matches_reference(arch, tiny_dirs):
    budget = 12
    prompts = make_prompts(PROMPT_LENS, seed=7)
    llm = make_llm(tiny_dirs[arch], "tova", dict(budget=budget))
    outs, history = run_recorded(llm, prompts)
    for out in outs:
        for _, kept in history[out.request_id]:
            for k in kept:  # never over budget between steps; one kept set shared by the layer's KV heads
                assert k.shape[1] <= budget and all(torch.equal(k[0], row) for row in k)
        if len(out.prompt_token_ids) > budget:
            assert kept_lengths(history[out.request_id])[-1] == [budget, budget]
    check_against_reference(llm, prompts, outs, history, lambda P: tova_rule(budget))


# --- Knorm ------------------------------------------------------------------------------------------------------
# Not on the tiny Qwen3: its key RMSNorm (unit weights in the random checkpoint) gives every key the same norm,
# sqrt(head_dim), so the ranking would be decided by rounding noise.
@pytest.mark.parametrize("arch,cfg", [
    ("qwen2", dict(budget=16)),
    ("llama", dict(budget=16, recent=4, evict_every=3, slack=2)),
    ("qwen2", dict(budget=12, recent=2, evict_every=1, skip_layers=[0])),
    ("glm4_moe_lite", dict(budget=16)),  # the latent rows' norms (the latent is RMS-normed, its RoPE part not)
])
def test_knorm_matches_reference(arch, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=8)
    llm = make_llm(tiny_dirs[arch], "knorm", cfg)
    outs, history = run_recorded(llm, prompts)
    skip = tuple(cfg.get("skip_layers", ()))
    for out in outs:
        P, done = len(out.prompt_token_ids), 0
        for n, kept in history[out.request_id]:
            done += n
            if done == P:  # right after the prompt: exactly `budget` per compressed layer
                want = [P if layer in skip or P <= cfg["budget"] else cfg["budget"] for layer in range(2)]
                assert [k.shape[1] for k in kept] == want
    ref_cfg = dict(cfg, skip_layers=skip)
    engine = {len(o.prompt_token_ids): engine_kept_by_end(history, o.request_id) for o in outs}
    check_against_reference(llm, prompts, outs, history, lambda P: knorm_rule(P, **ref_cfg, engine=engine[P]))


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


# --- dense when the budget covers the sequence ----------------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [
    ("tova", dict(budget=77)),
    ("knorm", dict(budget=77, evict_every=1)),
    ("rkv", dict(budget=70, buffer=8, alpha=8)),
])
def test_budget_covering_the_sequence_reproduces_dense(method, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=11)  # longest: 70 + 8 generated, 77 computed
    dense = make_llm(tiny_dirs["qwen3"]).generate(prompts, params())
    llm = make_llm(tiny_dirs["qwen3"], method, cfg)
    outs, history = run_recorded(llm, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for out in outs:
        for _, kept in history[out.request_id]:
            assert all(torch.equal(k, torch.arange(k.shape[1]).expand_as(k)) for k in kept)


# --- configuration ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("tova", {"budget": 0}),
    ("tova", {"budget": True}),
    ("tova", {"budget": 1.5}),
    ("tova", {"window": 4}),
    ("knorm", {"budget": 0}),
    ("knorm", {"budget": 8, "recent": 9}),
    ("knorm", {"recent": -1}),
    ("knorm", {"evict_every": -1}),
    ("knorm", {"slack": 0.5}),
    ("knorm", {"skip_layers": "0"}),
    ("knorm", {"skip_layers": [-1]}),
    ("knorm", {"skip_layers": [1, 1]}),
    ("rkv", {"alpha": 0}),
    ("rkv", {"budget": 8, "alpha": 8}),
    ("rkv", {"buffer": 0}),
    ("rkv", {"mix_lambda": 1.5}),
    ("rkv", {"mix_lambda": True}),
    ("rkv", {"kernel_size": 4}),
    ("rkv", {"threshold": 2.0}),
    ("rkv", {"gqa_pooling": "median"}),
    ("rkv", {"lambda": 0.1}),
])
def test_invalid_knobs_raise_config_error(method, options):
    with pytest.raises(ConfigError, match=method):
        create_method(method, options)


def test_knorm_skip_layers_out_of_range_is_refused_at_configuration(tiny_dirs):
    with pytest.raises(ConfigError, match="skip_layers"):
        make_llm(tiny_dirs["qwen3"], "knorm", dict(skip_layers=[2]))


def test_methods_register_with_family_defaults_and_entry_points():
    assert {"tova", "knorm", "rkv"} <= {ep.name for ep in entry_points(group="agentrt.methods")}
    for name in ("tova", "knorm", "rkv"):
        m = create_method(name)
        assert m.family is Family.EVICTION and m.name == name
        assert not m.needs.attention_scores
    assert create_method("tova").config == policies.tova.TOVAConfig(2048)
    assert create_method("knorm").config == policies.knorm_eviction.KnormConfig(2048, 0, 0, 0, ())
    assert create_method("rkv").config == policies.rkv.RKVConfig(512, 128, 8, 0.1, 7, 0.5, "max")
    assert create_method("knorm", {"skip_layers": [0, 1]}).config.skip_layers == (0, 1)
    # Knorm only overrides end_step, so decode steps may replay CUDA graphs whatever the request's state (here:
    # one still in its prompt); TOVA and R-KV stash queries in select
    in_prompt = SimpleNamespace(request_id="r", num_prompt_tokens=8, num_computed_tokens=0, num_preemptions=0)
    assert [create_method(n).decode_capabilities(in_prompt).replay for n in ("tova", "knorm", "rkv")] == \
        [False, True, False]


def test_admission_reserves_what_a_bounded_method_holds_not_the_dense_length(tiny_dirs):
    """R-KV and StreamingLLM bound a request's KV, so a generation longer than the whole pool is admitted and
    runs; the dense method refuses it."""
    from engine.errors import InvalidRequestError

    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="pages"):
        LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, num_pages=20).generate([prompt], params)
    for method, cfg in [("rkv", {"budget": 32, "buffer": 16, "alpha": 4}),
                        ("streaming_llm", {"sink_tokens": 4, "window": 28, "slack": 8})]:
        llm = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, num_pages=20, method=method,
                  method_config=cfg, max_num_batched_tokens=16)
        out = llm.generate([prompt], params)[0]
        assert len(out.token_ids) == 200 and llm.engine.scheduler.num_preemptions == 0


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
