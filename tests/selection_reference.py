"""The selection methods' dense step-by-step reference, what the engine's method selected, and the tiny checkpoints
they run on (module-scoped fixtures: import them by name into a test module). Tests: tests/policies/test_quest.py,
test_omnikv.py, test_selection_shared.py.

The references recompute the whole sequence each decode step with full-matrix attention (our model code,
checked against HF elsewhere). Inside that dense forward, at every layer, the newest row's visibility is
chosen from *that* forward's q/k by the paper's rule, so the reference is a step-by-step greedy loop whose
selection changes every step; earlier decode rows keep the visibility they had when they were the query,
prompt rows are dense (prefill runs dense). The engine's selections are captured by wrapping ``select`` and
must equal the reference's, and its tokens must equal both the reference loop's and ``greedy_with_mask``
under the captured visibility.
"""

import pytest
import torch

from engine import SamplingParams
from engine.contract import PagedView, SelectedSlotsView
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


# --- capturing what the engine's method selected --------------------------------------------------------------
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


# --- the dense step-by-step reference -------------------------------------------------------------------------
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
