"""The all-layer compaction kernels (agentrt_kernels.triton.kv_compact) against the dense storage's per-layer torch
indexing, and a SnapKV chain whose compactions run through them equal to one whose compactions do not. Without a
GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.triton.kv_compact import gather_kept, scatter_kept  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _torch_compaction(kv, old_slots, keep, new_slots):
    """engine.storage.dense.DenseKV.gather_kept / scatter_kept, layer by layer (all reads before any write)."""
    kv = kv.clone()
    kept = []
    for layer in range(kv.shape[0]):
        head_idx = torch.arange(keep.shape[1], device=kv.device)[None, :]
        kept.append((kv[layer, 0].flatten(0, 1)[old_slots[keep[layer].T], head_idx],
                     kv[layer, 1].flatten(0, 1)[old_slots[keep[layer].T], head_idx]))
    for layer, (k, v) in enumerate(kept):
        kv[layer, 0].flatten(0, 1)[new_slots[: k.shape[0]]] = k
        kv[layer, 1].flatten(0, 1)[new_slots[: k.shape[0]]] = v
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12: a partial block of columns
def test_compaction_in_place_equals_the_per_layer_torch_moves(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    layers, pages, page_size, heads = 3, 10, 4, 2
    kv = torch.randn(layers, 2, pages, page_size, heads, head_dim, generator=gen).to(DEVICE, dtype)
    table_pages = [7, 2, 5, 0, 9]  # the request's pages: 20 slots
    old_slots = torch.tensor([p * page_size + i for p in table_pages for i in range(page_size)], device=DEVICE)
    budget = 11  # 40 kept slots' worth of BLOCK_J tiles is not needed: a partial tile
    keep = torch.stack([torch.stack([torch.randperm(20, generator=gen)[:budget].sort().values
                                     for _ in range(heads)]) for _ in range(layers)]).to(DEVICE)
    new_slots = old_slots[: 3 * page_size]  # compacted into the table's own first pages: sources overlap
    want = _torch_compaction(kv, old_slots, keep, new_slots)
    kept = gather_kept(kv, old_slots, keep)
    scatter_kept(kv, kept, new_slots)
    assert torch.equal(kv, want)


def test_shapes_are_checked():
    kv = torch.zeros(2, 2, 3, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="keep"):
        gather_kept(kv, torch.arange(12, device=DEVICE), torch.zeros(2, 2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="new slots"):
        scatter_kept(kv, torch.zeros(2, 2, 5, 1, 8, device=DEVICE), torch.arange(4, device=DEVICE))


def test_a_snapkv_chain_compacted_by_the_kernels_equals_one_compacted_by_torch(tiny_dirs, monkeypatch):
    """Two turns of a SnapKV chain (each prompt compacted to the budget): the kernels' moves leave the pool
    byte for byte as the torch moves do, and the turns' tokens and logprobs are the same."""
    import engine.storage.dense as dense
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.chain_helpers import run_chain_turn

    calls = []
    original = dense.DenseKV.gather_kept_layers

    def counting(self, table, old_slots, keep):
        calls.append(len(keep))
        return original(self, table, old_slots, keep)

    monkeypatch.setattr(dense.DenseKV, "gather_kept_layers", counting)

    def run(fused: bool):
        monkeypatch.setattr(dense, "fuse_compaction", lambda kv: fused)
        engine = LLMEngine(EngineConfig(tiny_dirs["llama"], dtype="float32", device=str(DEVICE), page_size=4,
                                        num_pages=256, method="snapkv", method_config={"budget": 24, "window": 4},
                                        warmup=False))  # a GPU engine's warm-up prompt would be compacted too
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=True)
        first = run_chain_turn(engine, "c", list(range(5, 65)), params)
        second = run_chain_turn(engine, "c", list(range(5, 65)) + first.token_ids + list(range(70, 110)), params)
        return first, second, engine.cache.storage.kv.clone()

    plain, fused = run(False), run(True)
    assert len(calls) == 4  # two compactions a run
    for a, b in zip(plain[:2], fused[:2]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert torch.equal(plain[2], fused[2])
