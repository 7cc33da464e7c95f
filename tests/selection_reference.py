"""Selection methods (Quest, OmniKV) against references written from the papers' definitions.

The references recompute the whole sequence each decode step with full-matrix attention (our model code,
checked against HF elsewhere). Inside that dense forward, at every layer, the newest row's visibility is
chosen from *that* forward's q/k by the paper's rule, so the reference is a step-by-step greedy loop whose
selection changes every step; earlier decode rows keep the visibility they had when they were the query,
prompt rows are dense (prefill runs dense). The engine's selections are captured by wrapping ``select`` and
must equal the reference's, and its tokens must equal both the reference loop's and ``greedy_with_mask``
under the captured visibility.
"""

import dataclasses

import pytest
import torch

import policies.omnikv  # noqa: F401  (registers "omnikv")
import policies.quest  # noqa: F401  (registers "quest")
from engine import LLM, SamplingParams
from engine.attention_backend import TorchReferenceBackend
from engine.contract import PagedView, SelectedSlotsView
from engine.errors import ConfigError
from engine.registry import create_method
from agentrt_kernels.torch_ref import page_key_bounds, quest_page_scores, selected_slots_attention
from tests.dense_reference import causal, from_scratch, greedy_with_mask

PAGE = 4
NUM_LAYERS = 5
MAX_NEW = 8
PROMPT_LENS = (20, 45, 70)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("sel") / "qwen3", "qwen3", seed=11, hidden_size=64,
                                num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2, head_dim=32,
                                intermediate_size=128, vocab_size=512, max_position_embeddings=1024,
                                initializer_range=0.1)


@pytest.fixture(scope="module")
def selection_dirs(model_dir, tmp_path_factory):
    """The 5-layer Qwen3 and a 5-layer GLM-4.7-Flash-like model (latent rows: one KV head, absorbed queries)."""
    from engine.tiny_checkpoint import make_tiny_checkpoint

    mla = make_tiny_checkpoint(tmp_path_factory.mktemp("sel") / "glm", "glm4_moe_lite", seed=12, hidden_size=64,
                               num_layers=NUM_LAYERS, num_heads=4, head_dim=16, intermediate_size=128,
                               vocab_size=512, max_position_embeddings=1024, initializer_range=0.1,
                               kv_lora_rank=32, qk_rope_head_dim=8)
    hybrid = make_tiny_checkpoint(tmp_path_factory.mktemp("sel") / "qwen3_5", "qwen3_5", seed=13, hidden_size=64,
                                  num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
                                  vocab_size=512, max_position_embeddings=1024, initializer_range=0.1)
    return {"qwen3": model_dir, "glm4_moe_lite": mla, "qwen3_5": hybrid}


def make_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=True)


def cdiv(a, b):
    return -(-a // b)


# --- capturing what the engine's method selected ---------------------------------------------------------
def visible_positions(view: PagedView, i: int, pages: list[int]) -> list[int]:
    """Logical positions request ``i`` reads through ``view`` (its resident pages are ``pages``)."""
    length = view.kv_lens_cpu[i]
    if isinstance(view, SelectedSlotsView):
        a, b = view.slot_indptr[i].item(), view.slot_indptr[i + 1].item()
        assert b - a == length
        slots = view.slot_indices[a:b].tolist()
        positions = [pages.index(s // PAGE) * PAGE + s % PAGE for s in slots]
        assert positions == sorted(set(positions)), "slots must be listed in increasing logical order"
        return positions
    n = cdiv(length, PAGE)
    logical = [pages.index(p) for p in view.block_tables[i, :n].tolist()]
    assert logical == sorted(set(logical)), "pages must be listed in increasing logical order"
    positions = []
    for j, page in enumerate(logical):
        count = PAGE if j < n - 1 else length - (n - 1) * PAGE
        positions.extend(range(page * PAGE, page * PAGE + count))
    return positions


def capture_selections(llm) -> dict:
    """(request_id, query position, layer) -> logical positions read, for every decode query."""
    method, cache = llm.engine.method, llm.engine.cache
    seen: dict = {}
    original = method.select

    def select(layer, q, batch):
        view = original(layer, q, batch)
        for i, (req, n) in enumerate(zip(batch.requests, view.query_lens_cpu)):
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                pages = cache.table(req).pages
                positions = visible_positions(view, i, pages)
                assert positions[-1] == req.num_computed_tokens, "the new token must be read, and last"
                seen[(req.request_id, req.num_computed_tokens, layer)] = positions
        return view

    method.select = select
    return seen


def of_request(seen: dict, request_id: str) -> dict:
    return {(pos, layer): v for (rid, pos, layer), v in seen.items() if rid == request_id}


# --- the dense step-by-step reference ---------------------------------------------------------------------
class SelectingDenseRunner:
    """Full [T, T] attention. Row ``r >= prompt_len`` (a decode query) of layer ``l`` sees exactly
    ``chosen[(r, l)]``; a row seen for the first time gets ``choose(layer, r, q[r], k[:r + 1])``."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, prompt_len, chosen, choose):
        self.prompt_len, self.chosen, self.choose = prompt_len, chosen, choose

    def attention(self, layer, q, k, v):
        T, hq, d = q.shape
        group = hq // k.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for row in range(self.prompt_len, T):
            if (row, layer) not in self.chosen:
                self.chosen[(row, layer)] = list(self.choose(layer, row, q[row], k[: row + 1]))
            mask[row] = False
            mask[row, self.chosen[(row, layer)]] = True
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * d**-0.5
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1)).to(q.dtype)

    def end_layer(self, layer, hidden):
        pass


@torch.no_grad()
def reference_decode(model, prompt, max_new, choose):
    chosen: dict = {}
    ids = list(prompt)
    for _ in range(max_new):
        runner = from_scratch(SelectingDenseRunner(len(prompt), chosen, choose), model, len(ids))
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), runner)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):], chosen


def mask_from(selections: dict, prompt_len: int, num_kv_heads: int = 2):
    def visible(layer, T):
        m = causal(num_kv_heads, T).clone()
        for row in range(prompt_len, T):
            m[:, row] = False
            m[:, row, selections[(row, layer)]] = True
        return m
    return visible


def quest_reference(budget: int, dense_layers: int, aggregate: str):
    """Quest from the paper: per page the elementwise min/max of its keys (same page boundaries: page j holds
    positions [j*PAGE, (j+1)*PAGE)), per query head U = sum_d max(q_d min_d, q_d max_d), heads aggregated,
    top pages + the last page under budget // PAGE pages."""
    def choose(layer, row, q_row, k):
        T = row + 1
        n_pages, n_sel = cdiv(T, PAGE), budget // PAGE
        if layer < dense_layers or T <= budget or n_pages <= n_sel:
            return range(T)
        group = q_row.shape[0] // k.shape[1]
        scores = []
        for j in range(n_pages - 1):
            keys = k[j * PAGE:(j + 1) * PAGE].float()  # [PAGE, Hkv, D]
            lo = keys.min(dim=0).values.repeat_interleave(group, 0)  # [Hq, D]
            hi = keys.max(dim=0).values.repeat_interleave(group, 0)
            per_head = torch.maximum(q_row.float() * lo, q_row.float() * hi).sum(-1)  # [Hq]
            scores.append(per_head.max() if aggregate == "max" else per_head.sum())
        top = sorted(torch.stack(scores).topk(n_sel - 1).indices.tolist()) + [n_pages - 1]
        return [p for j in top for p in range(j * PAGE, min((j + 1) * PAGE, T))]
    return choose


def omnikv_reference(observation_layers, budget):
    """OmniKV: an observation layer attends fully and ranks every slot by its attention probability summed over
    query heads; the newest token plus the top budget - 1 others are what the following layers see."""
    picked: dict = {}

    def choose(layer, row, q_row, k):
        T = row + 1
        if layer < observation_layers[0] or T <= budget:
            return range(T)
        if layer in observation_layers:
            group = q_row.shape[0] // k.shape[1]
            logits = torch.einsum("hd,khd->hk", q_row.float(), k.float().repeat_interleave(group, 1))
            score = torch.softmax(logits * q_row.shape[-1] ** -0.5, dim=-1).sum(0)  # [T]
            picked[row] = sorted(score[: T - 1].topk(budget - 1).indices.tolist()) + [T - 1]
            return range(T)
        return picked[row]
    return choose


def check_against_reference(llm, outs, prompts, seen, make_choose):
    model = llm.engine.model
    dropped = False
    for out, prompt in zip(outs, prompts):
        got = of_request(seen, out.request_id)
        ref_tokens, ref_chosen = reference_decode(model, prompt, MAX_NEW, make_choose())
        assert set(got) == set(ref_chosen)
        for key in sorted(ref_chosen):
            assert got[key] == ref_chosen[key], f"request {out.request_id} (position, layer) {key}"
        assert out.token_ids == ref_tokens
        assert out.token_ids == greedy_with_mask(model, prompt, MAX_NEW,
                                                 mask_from(got, len(prompt), llm.engine.model_config.num_kv_heads))
        dropped |= any(len(v) < pos + 1 for (pos, _), v in got.items())
    assert dropped, "the budget should have made the method drop tokens"


# --- Quest -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,aggregate,path", [("qwen3", "max", "device"), ("qwen3", "sum", "device"),
                                                  ("qwen3", "max", "host"), ("glm4_moe_lite", "max", "device"),
                                                  ("qwen3_5", "max", "device")])
def test_quest_selects_and_decodes_like_the_dense_reference(selection_dirs, arch, aggregate, path):
    """``path``: pure-decode steps select on the device (what a decode graph captures), or, forced, through
    the host plan that prompt steps use."""
    model_dir = selection_dirs[arch]
    cfg = {"token_budget": 18, "dense_layers": 1, "aggregate": aggregate}  # 4 pages: 18 is not a page multiple
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=24,
              method="quest", method_config=cfg)
    method, device_steps = llm.engine.method, []
    if path == "host":
        method._all_decode = lambda batch: False
    else:
        inner = method._select_decode
        method._select_decode = lambda *a: device_steps.append(1) or inner(*a)
    seen = capture_selections(llm)
    prompts = make_prompts()
    outs = llm.generate(prompts, GREEDY)
    # a later request reusing published prompt pages: their min/max came along with the page ids
    shared = [prompts[2][:48] + make_prompts(1)[0][:9]]
    outs_shared = llm.generate(shared, GREEDY)
    cached = outs_shared[0].num_cached_tokens
    if llm.engine.cache.storage.aligned_prefill:  # a hybrid: up to the last state checkpoint among the 48 tokens
        assert 0 < cached <= 48 and cached % PAGE == 0
    else:
        assert cached == 48
    choose = lambda: quest_reference(cfg["token_budget"], cfg["dense_layers"], aggregate)  # noqa: E731
    check_against_reference(llm, outs + outs_shared, prompts + shared, seen, choose)
    short = of_request(seen, outs[0].request_id)
    assert all(len(v) == pos + 1 for (pos, layer), v in short.items() if layer < 1)  # dense layer
    assert all(r == 0 for r in llm.engine.pool.ref_counts)
    assert (len(device_steps) > 0) == (path == "device")


# --- OmniKV ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,observation_layers,path", [("qwen3", (1, 3), "device"), ("qwen3", (2,), "device"),
                                                           ("qwen3", (1, 3), "host"), ("glm4_moe_lite", (1, 3), "device"),
                                                           ("qwen3_5", (1, 3), "device")])
def test_omnikv_selects_and_decodes_like_the_dense_reference(selection_dirs, arch, observation_layers, path):
    """``path``: pure-decode steps choose on the device (what a decode graph captures) or, forced, on the host."""
    model_dir = selection_dirs[arch]
    budget = 12
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16,
              method="omnikv", method_config={"observation_layers": list(observation_layers), "token_budget": budget})
    method, device_steps = llm.engine.method, []
    assert method.config.observation_layers == observation_layers
    if path == "host":
        method._all_decode = lambda batch: False
    else:
        inner = method._choose_decode
        method._choose_decode = lambda *a: device_steps.append(1) or inner(*a)
    seen = capture_selections(llm)
    prompts = make_prompts(2)
    outs = llm.generate(prompts, GREEDY)
    check_against_reference(llm, outs, prompts, seen, lambda: omnikv_reference(observation_layers, budget))
    for (_, pos, layer), v in seen.items():
        if layer <= observation_layers[0] or layer in observation_layers:
            assert len(v) == pos + 1  # dense and observation layers read everything
        else:
            assert len(v) == min(budget, pos + 1)
    assert (len(device_steps) > 0) == (path == "device")


# --- budgets that hold everything reproduce dense ---------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [("quest", {"dense_layers": 0}), ("quest", {}),
                                        ("omnikv", {"observation_layers": (0, 2)}), ("omnikv", {})])
def test_a_budget_holding_everything_reproduces_dense(model_dir, method, cfg):
    prompts = make_prompts(3)
    kw = dict(dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=32)
    dense = LLM(model_dir, **kw).generate(prompts, GREEDY)
    sparse = LLM(model_dir, method=method, method_config=cfg, **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in sparse] == [o.token_ids for o in dense]
    assert [o.logprobs for o in sparse] == [o.logprobs for o in dense]


# --- knobs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("quest", {"token_budget": 0}), ("quest", {"token_budget": "64"}), ("quest", {"token_budget": True}),
    ("quest", {"dense_layers": -1}), ("quest", {"aggregate": "mean"}), ("quest", {"budget": 64}),
    ("omnikv", {"observation_layers": ()}), ("omnikv", {"observation_layers": (2, 1)}),
    ("omnikv", {"observation_layers": (1, 1)}), ("omnikv", {"observation_layers": (-1,)}),
    ("omnikv", {"observation_layers": 1}), ("omnikv", {"token_budget": 0}), ("omnikv", {"dense_layers": 1}),
])
def test_invalid_knobs_raise_config_error(method, options):
    with pytest.raises(ConfigError):
        create_method(method, options)


def test_knobs_checked_against_the_model_raise_config_error(model_dir):
    kw = dict(dtype="float32", device="cpu", page_size=PAGE)
    with pytest.raises(ConfigError, match="page"):
        LLM(model_dir, method="quest", method_config={"token_budget": PAGE - 1}, **kw)
    with pytest.raises(ConfigError, match="observation layer"):
        LLM(model_dir, method="omnikv", method_config={"observation_layers": (1, NUM_LAYERS)}, **kw)
    m = create_method("omnikv", {"observation_layers": [2, 4]})
    assert m.config.observation_layers == (2, 4) and m.config.dense_layers == 2
    assert dataclasses.asdict(create_method("quest", None).config) == {
        "token_budget": 1024, "dense_layers": 2, "aggregate": "max"}


# --- kernels ---------------------------------------------------------------------------------------------
def _random_slots(g, num_slots, counts):
    lists = [torch.randperm(num_slots, generator=g)[:c] for c in counts]
    lists = [torch.cat([x[1:].sort().values, x[:1]]) for x in lists]  # arbitrary order; any order is legal
    indptr = torch.tensor([0] + [sum(counts[: i + 1]) for i in range(len(counts))])
    return lists, indptr, torch.cat(lists)


def _dense_slots_attention(q, k_flat, v_flat, lists, query_lens, scale):
    out, probs, start = torch.empty_like(q), [], 0
    for idx, n in zip(lists, query_lens):
        group = q.shape[1] // k_flat.shape[1]
        p_req = torch.zeros(q.shape[1], n, len(idx))
        for j in range(n):
            sees = idx[: len(idx) - n + j + 1]
            for h in range(q.shape[1]):
                logits = torch.stack([q[start + j, h] @ k_flat[s, h // group] for s in sees]) * scale
                p = torch.softmax(logits, 0)
                out[start + j, h] = sum(pi * v_flat[s, h // group] for pi, s in zip(p, sees))
                p_req[h, j, : len(sees)] = p
        probs.append(p_req)
        start += n
    return out, probs


def test_selected_slots_attention_matches_a_dense_computation():
    g = torch.Generator().manual_seed(0)
    pages, hq, hkv, d = 10, 4, 2, 8
    k_cache, v_cache = torch.randn(2, pages, PAGE, hkv, d, generator=g)
    counts = [5, 1, 17, 9]
    lists, indptr, indices = _random_slots(g, pages * PAGE, counts)
    scale = d**-0.5
    q = torch.randn(len(counts), hq, d, generator=g)
    out, scores = selected_slots_attention(q, k_cache, v_cache, indptr, indices, scale)
    expected, _ = _dense_slots_attention(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), lists, [1] * 4, scale)
    assert scores is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    query_lens = [2, 1, 5, 3]  # several queries per request: causal over list order
    q = torch.randn(sum(query_lens), hq, d, generator=g)
    out, scores = selected_slots_attention(q, k_cache, v_cache, indptr, indices, scale, query_lens=query_lens,
                                           slot_counts=counts, return_scores=True)
    expected, probs = _dense_slots_attention(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), lists, query_lens,
                                             scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(scores, probs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    view = SelectedSlotsView(block_tables=torch.zeros(4, 1, dtype=torch.int32), kv_lens=torch.tensor(counts),
                             query_start_loc=torch.tensor([0, 2, 3, 8, 11]), page_size=PAGE, kv_lens_cpu=counts,
                             query_lens_cpu=query_lens, slot_indptr=indptr, slot_indices=indices)
    backend = TorchReferenceBackend()
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache, view, scale)[0], expected, atol=1e-5, rtol=1e-5)
    assert backend.unsupported(create_method("omnikv")) == []
    assert backend.unsupported(create_method("quest")) == []

    class PagesOnly(TorchReferenceBackend):
        accepted_views = (PagedView,)
    assert PagesOnly().unsupported(create_method("quest")) == []
    assert PagesOnly().unsupported(create_method("omnikv")) == ["the torch backend cannot read SelectedSlotsView"]

    class SomeHeads(TorchReferenceBackend):
        head_dims = (64, 128)
    assert SomeHeads().unsupported(create_method("quest"), head_dim=128) == []
    assert SomeHeads().unsupported(create_method("quest"), head_dim=16) == [
        "the torch backend does not run head_dim 16 (it runs [64, 128])"]


def test_quest_page_bounds_and_scores_match_their_definition():
    g = torch.Generator().manual_seed(1)
    pages, hq, hkv, d = 6, 4, 2, 8
    k_cache = torch.randn(pages, PAGE, hkv, d, generator=g)
    page_ids, valid = torch.tensor([4, 0, 2]), torch.tensor([PAGE, 1, 3])
    lo, hi = page_key_bounds(k_cache, page_ids, valid)
    for n, (p, c) in enumerate(zip(page_ids.tolist(), valid.tolist())):
        torch.testing.assert_close(lo[n], k_cache[p, :c].min(0).values)
        torch.testing.assert_close(hi[n], k_cache[p, :c].max(0).values)
    q = torch.randn(2, hq, d, generator=g)
    kmin, kmax = lo[None].expand(2, -1, -1, -1), hi[None].expand(2, -1, -1, -1)
    for aggregate in ("max", "sum"):
        scores = quest_page_scores(q, kmin, kmax, aggregate)
        for b in range(2):
            for n in range(3):
                per_head = torch.stack([sum(max(q[b, h, i] * lo[n, h // 2, i], q[b, h, i] * hi[n, h // 2, i])
                                            for i in range(d)) for h in range(hq)])
                want = per_head.max() if aggregate == "max" else per_head.sum()
                torch.testing.assert_close(scores[b, n], want, atol=1e-5, rtol=1e-5)
                p, c = page_ids[n], valid[n]  # the per-head score bounds every logit in the page
                logits = torch.einsum("hd,khd->hk", q[b], k_cache[p, :c].repeat_interleave(2, 1))
                assert (logits <= per_head[:, None] + 1e-5).all()
