"""Compaction (the mechanism under every eviction method): kept slots, logical positions, freed pages."""

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.contract import Family, SparseMethod
from engine.contract.method import DecodeCapabilities
from engine.registry import register_method
from tests.dense_reference import causal, greedy_with_mask

PAGE = 4


@dataclasses.dataclass(slots=True, frozen=True)
class KeepConfig:
    budgets: tuple[int, ...] = (6, 9)  # per layer
    seed: int = 0
    min_prompt: int = 0  # prompts shorter than this stay dense


@register_method
class KeepRandom(SparseMethod):
    """After the prompt, keep a seeded random subset per (layer, kv head), always including the last slot."""

    name = "test-keep-random"
    family = Family.EVICTION
    Config = KeepConfig
    decode = DecodeCapabilities(window=1)  # no windows of decode steps: end_step looks at every step
    kept: dict = {}

    def end_step(self, batch):
        cache = batch.cache
        for req in batch.finished_prompt:
            if req.num_prompt_tokens < self.config.min_prompt:
                continue
            g = torch.Generator().manual_seed(self.config.seed + req.num_prompt_tokens)
            keep = []
            n = cache.physical_len(req, 0)
            for budget in self.config.budgets:
                rows = [torch.cat([torch.randperm(n - 1, generator=g)[: budget - 1], torch.tensor([n - 1])]).sort().values
                        for _ in range(cache.spec.num_kv_heads)]
                keep.append(torch.stack(rows))
            before = cache.num_pages_held(req)
            assert cache.compact(req, keep)
            assert [cache.physical_len(req, i) for i in range(len(keep))] == list(self.config.budgets)
            assert cache.num_pages_held(req) == -(-max(self.config.budgets) // PAGE) <= before
            self.kept[req.request_id] = [cache.positions_of(req, i).clone() for i in range(len(keep))]


def mask_from_kept(kept: list[torch.Tensor], prompt_len: int):
    def visible(layer, T):
        m = causal(kept[layer].shape[0], T).clone()
        for h, positions in enumerate(kept[layer]):
            row = torch.zeros(prompt_len, dtype=torch.bool)
            row[positions] = True
            m[h, prompt_len:, :prompt_len] = row
        return m
    return visible


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compacted_requests_decode_like_the_masked_dense_reference(arch, make_llm):
    llm = make_llm(arch, page_size=PAGE, max_num_batched_tokens=16, method="test-keep-random",
                   method_config={"budgets": (6, 9)})
    prompts = [list(range(10, 40)), list(range(50, 63)), [7] * 21 + list(range(100, 120))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    KeepRandom.kept = {}
    outs = llm.generate(prompts, params)
    model = llm.engine.model
    for out, prompt in zip(outs, prompts):
        kept = KeepRandom.kept[out.request_id]
        assert all(k.shape[1] == b for k, b in zip(kept, (6, 9)))
        expected = greedy_with_mask(model, prompt, 8, mask_from_kept(kept, len(prompt)))
        assert out.token_ids == expected
    assert all(r == 0 for r in llm.engine.pool.ref_counts)


def test_compaction_never_overwrites_pages_shared_through_the_prefix_cache(make_llm):
    prompt = list(range(10, 42))
    dense = make_llm("qwen3", page_size=PAGE)
    long_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    llm = make_llm("qwen3", page_size=PAGE, method="test-keep-random", method_config={"min_prompt": 40})
    engine, pool = llm.engine, llm.engine.pool
    a = engine.add_request(prompt, long_params)  # stays dense, holds the published prompt pages
    engine.step()
    shared_pages = list(engine.cache.table(engine._requests[a]).pages[:8])
    b = engine.add_request(prompt + list(range(200, 212)), short_params)  # hits them, then compacts
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[b].num_cached_tokens == 32
    assert outs[a].token_ids == dense.generate([prompt], long_params)[0].token_ids
    c = llm.generate([prompt + [5]], short_params)[0]  # the shared pages are still published and intact
    assert c.num_cached_tokens == 32
    assert c.token_ids == dense.generate([prompt + [5]], short_params)[0].token_ids
    assert all(pool.ref_counts[p] == 0 for p in shared_pages)
