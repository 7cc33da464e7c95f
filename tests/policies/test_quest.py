"""Quest against a reference written from its paper's definition, and its page bounds and scores.

The reference is ``tests/selection_reference.py``'s (its module docstring says how) with the method's rule applied
from its definition: the engine's selections, its tokens and masked greedy tokens must agree.
"""

import pytest
import torch

import policies.quest  # noqa: F401  (registers "quest")
from engine import LLM
from agentrt_kernels.torch_ref import page_key_bounds, quest_page_scores
from tests.selection_reference import (
    GREEDY,
    PAGE,
    capture_selections,
    cdiv,
    check_against_reference,
    make_prompts,
    of_request,
)
from tests.selection_reference import model_dir, selection_dirs  # noqa: F401 (fixtures)


# --- references from the papers' definitions ------------------------------------------------------------------
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


# --- Quest ----------------------------------------------------------------------------------------------------
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


# --- kernels --------------------------------------------------------------------------------------------------
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
