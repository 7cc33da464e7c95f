"""Quest and OmniKV together: a budget holding everything reproduces dense, invalid knobs (alone and against the
model), the selected-slots attention against a dense computation and the backends' support of both. Each method
against the reference written from its paper's definition: tests/policies/test_quest.py, test_omnikv.py.
"""

import dataclasses

import pytest
import torch

import policies.omnikv  # noqa: F401  (registers "omnikv")
import policies.quest  # noqa: F401  (registers "quest")
from engine import LLM
from engine.attention_backend import TorchReferenceBackend
from engine.contract import PagedView, SelectedSlotsView
from engine.errors import ConfigError
from engine.registry import create_method
from agentrt_kernels.torch_ref import selected_slots_attention
from tests.selection_reference import GREEDY, NUM_LAYERS, PAGE, make_prompts
from tests.selection_reference import model_dir  # noqa: F401 (fixtures)


# --- budgets that hold everything reproduce dense -------------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [("quest", {"dense_layers": 0}), ("quest", {}),
                                        ("omnikv", {"observation_layers": (0, 2)}), ("omnikv", {})])
def test_a_budget_holding_everything_reproduces_dense(model_dir, method, cfg):
    prompts = make_prompts(3)
    kw = dict(dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=32)
    dense = LLM(model_dir, **kw).generate(prompts, GREEDY)
    sparse = LLM(model_dir, method=method, method_config=cfg, **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in sparse] == [o.token_ids for o in dense]
    assert [o.logprobs for o in sparse] == [o.logprobs for o in dense]


# --- knobs ----------------------------------------------------------------------------------------------------
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


# --- kernels --------------------------------------------------------------------------------------------------
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
