"""A KV storage written here, outside the engine, plugs in through ``KVStorage`` alone: one that keeps keys and
values in two separate tensors (unlike ``DenseKV``'s one) serves the dense parity checks against HF
transformers, prefix hits, chains with forks, and SnapKV's compaction, with the outputs of the built-in
dense storage."""

import random

import pytest
import torch

from engine import SamplingParams
from engine.contract import KVStorage, SparseMethod
from engine.paged_cache import PagedCacheManager
from engine.registry import METHODS, create_method
from tests.chain_helpers import run_chain_turn
from tests.hf_reference import hf_greedy


class SeparateKV(KVStorage):
    """Keys in one tensor, values in another, each ``[layers, pages, page_size, Hkv, D]``; every write a plain
    index copy (no fused kernel)."""

    def __init__(self, spec, num_pages):
        super().__init__(spec, num_pages)
        shape = (spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.writes = 0

    def write(self, layer, k, v, slots, positions=None):
        self.writes += 1
        self.k[layer].flatten(0, 1)[slots] = k.to(self.k.dtype)
        self.v[layer].flatten(0, 1)[slots] = v.to(self.v.dtype)

    def write_prefix(self, table, layer, k, v, slots):
        self.write(layer, k, v, slots)

    def copy_pages(self, src, dst):
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def gather_kept(self, layer, table, old_slots, keep):
        heads = torch.arange(keep.shape[0], device=keep.device)[None, :]
        return (self.k[layer].flatten(0, 1)[old_slots[keep.T], heads],
                self.v[layer].flatten(0, 1)[old_slots[keep.T], heads])

    def scatter_kept(self, layer, table, kept, new_slots):
        k, v = kept
        self.k[layer].flatten(0, 1)[new_slots[:k.shape[0]]] = k
        self.v[layer].flatten(0, 1)[new_slots[:v.shape[0]]] = v

    def layer_kv(self, layer):
        return self.k[layer], self.v[layer]


def storage_method(base: type[SparseMethod], name: str) -> type[SparseMethod]:
    """``base`` with its cache's storage replaced by ``SeparateKV`` (the engine's configured method)."""

    class WithSeparateKV(base):
        def make_cache(self, spec, pool, enable_prefix_caching):
            self.storage = SeparateKV(spec, pool.num_pages + 1)
            return PagedCacheManager(spec, pool, enable_prefix_caching=enable_prefix_caching, storage=self.storage)

    WithSeparateKV.name = name
    METHODS.register(WithSeparateKV)
    return WithSeparateKV


storage_method(SparseMethod, "test_separate_kv_dense")
storage_method(type(create_method("snapkv", {"budget": 24, "window": 8})), "test_separate_kv_snapkv")


def prompts(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(40)]
    bodies = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 70, 17, 33)]
    return system, [system + b if i % 2 == 0 else b for i, b in enumerate(bodies)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_storage_of_its_own_matches_hf_with_prefix_hits(arch, tiny_dirs, make_llm):
    llm = make_llm(arch, page_size=8, max_num_batched_tokens=32, method="test_separate_kv_dense")
    system, ps = prompts(llm.engine.model_config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([system + [5]], params)  # publish the shared system prompt's pages
    outs = llm.generate(ps, params)
    eos = sorted(llm.engine.model_config.eos_token_ids)
    for prompt, out in zip(ps, outs):
        assert out.token_ids == hf_greedy(tiny_dirs[arch], prompt, 8, eos)
    assert max(o.num_cached_tokens for o in outs) >= 40 // 8 * 8  # the prefix hits read the plugged storage
    assert llm.engine.method.storage.writes > 0
    assert llm.engine.cache.storage is llm.engine.method.storage


@pytest.mark.parametrize("method,builtin,config", [
    ("test_separate_kv_dense", "dense", {}),
    ("test_separate_kv_snapkv", "snapkv", {"budget": 24, "window": 8}),
])
def test_a_storage_of_its_own_gives_the_builtin_outputs_with_chains_forks_and_compaction(method, builtin, config,
                                                                                         make_llm):
    def run(name):
        llm = make_llm("qwen3", page_size=8, max_num_batched_tokens=32, method=name, method_config=config)
        ps = prompts(llm.engine.model_config.vocab_size, seed=5)[1]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = [o.token_ids for o in llm.generate(ps, params)]
        outs += [o.token_ids for o in llm.generate([ps[0] + [9, 10, 11]], params)]  # a prefix hit
        engine = llm.engine  # a chain of three turns, forked after the first: both branches resume their KV
        history = {"a": ps[1] + run_chain_turn(engine, "a", ps[1], params).token_ids}
        engine.fork_chain("a", "b")
        history["b"] = list(history["a"])
        for chain, extra in (("a", [7, 8, 9]), ("b", [4, 5]), ("a", [6])):
            out = run_chain_turn(engine, chain, history[chain] + extra, params)
            outs.append(out.token_ids + [out.num_resumed_tokens])
            history[chain] += extra + out.token_ids
        return outs, llm

    want, _ = run(builtin)
    got, llm = run(method)
    assert got == want
    assert llm.engine.method.storage.writes > 0
