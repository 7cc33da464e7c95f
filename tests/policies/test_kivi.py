"""The KIVI KV codec against its definition (group min/max, tests/codec_reference.py): reconstruction error within
half a step, greedy tokens against the incremental dense reference, chains' windows, and the window write plans
(device against host, host against the per-request definition).
"""

import pytest
import torch

from engine import SamplingParams
from engine.contract.codec import CodedCacheSpec
from engine.registry import create_kv_storage
from tests.codec_reference import (
    KIVI,
    kivi_keys,
    kivi_values,
    kv_samples,
    make_llm,
    prompts,
    record_steps,
    replay,
    roundtrip,
)


# --- reconstruction -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_within_half_a_step(bits, tiny_dirs):
    codec = create_kv_storage("kivi", {"bits": bits, "group_size": 8, "residual": 0})
    for _, k, v in kv_samples(tiny_dirs):
        for side, x, ref in (("key", k, kivi_keys), ("value", v, kivi_values)):
            got = roundtrip(codec, side, x)
            want, scale = ref(x, bits, 8)
            assert ((got - x).abs() <= scale / 2 * (1 + 1e-3) + 1e-6).all()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            # the step itself is (max - min) / (2^b - 1) up to fp16 rounding
            if side == "value":
                grouped = x.view(x.shape[0], x.shape[1], -1, 8)
                step = ((grouped.amax(-1) - grouped.amin(-1)) / (2**bits - 1)).repeat_interleave(8, -1)
                assert (scale <= step * (1 + 2**-9) + 2e-4 * x.abs().amax()).all()


# --- attention and tokens -------------------------------------------------------------------------------------
def kivi_readout(bits, group, residual):
    def readout(layer, k, v, n):
        q = max(0, (n - residual) // group * group)
        kq, _ = kivi_keys(k[:q], bits, group)
        vq, _ = kivi_values(v[:q], bits, group)
        return torch.cat([kq, k[q:]]), torch.cat([vq, v[q:]])
    return readout


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_greedy_matches_incremental_reference(bits, tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"], "kivi", {**KIVI, "bits": bits})
    steps = record_steps(llm)
    ps = prompts([70, 37, 9])
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for out, p in zip(outs, ps):
        want = replay(llm.engine.model, p, steps[out.request_id], kivi_readout(bits, 8, 16), 24)
        assert out.token_ids == want
    assert all(r == 0 for r in llm.engine.pool.ref_counts)


# --- chains ---------------------------------------------------------------------------------------------------
def test_kivi_chains_release_windows_and_resume(tiny_dirs):
    from tests.chain_helpers import run_chain_turn

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = make_llm(tiny_dirs["qwen3"], "kivi", KIVI, max_num_seqs=2)
    eng = llm.engine
    free = lambda: len(eng.cache.storage._free_windows)  # noqa: E731
    assert free() == 2
    history = prompts([45])[0]
    outs = {}
    for i, cid in enumerate("abc"):  # three idle chains, two windows: windows go with running requests only
        outs[cid] = run_chain_turn(eng, cid, history + [i + 3], params)
        assert outs[cid].resume_status == "created" and free() == 2
    resumed = history + [3] + outs["a"].token_ids + [11, 12]
    out = run_chain_turn(eng, "a", resumed, params)
    assert out.resume_status == "resumed" and out.num_prefilled_tokens == 3 and free() == 2
    assert len(out.token_ids) == 5
    for cid in "abc":
        eng.delete_chain(cid)
    eng.clear_prefix_cache()
    assert eng.pool.num_free == eng.pool.num_pages


# --- window write plans ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [{"bits": 4, "group_size": 4, "residual": 8}, {"bits": 2, "group_size": 8, "residual": 0}])
def test_device_decode_plan_equals_the_host_plan(cfg):
    """``plan_decode`` (device, fixed shapes, what decode graphs capture) writes what the host
    ``plan_rows`` of the same decode step writes: the same group slots from the same ring or row sources, and the
    new row into the same ring slot (or, where the host writes none, into the scratch window)."""
    from engine.storage import CodedStorage
    from engine.storage.write_plans import plan_decode, plan_rows

    codec = create_kv_storage("kivi", cfg)
    ps, windows, cap = 8, 6, codec.window_capacity
    spec = CodedCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
                          page_size=ps, codec=codec, max_windows=windows)
    storage = CodedStorage(spec, num_pages=48)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 60, (2, 5), generator=g)  # [layers, requests] lengths after the step
    wids = torch.randperm(windows, generator=g)[:5]
    tables = torch.randperm(47, generator=g)[:5 * 8].view(5, 8) + 1
    plans = plan_decode(storage, lens.to(torch.int32), wids.to(torch.int32), tables.to(torch.int32), ps)
    for layer, dev in enumerate(plans):
        host = plan_rows(storage, [(wids[i].item(), lens[layer, i].item() - 1, 1, i) for i in range(5)], tables.tolist())
        assert torch.equal(dev.group_slots, host.group_slots)
        assert torch.equal(dev.from_ring, host.from_ring)
        assert torch.equal(dev.ring_src[host.from_ring], host.ring_src[host.from_ring])
        assert torch.equal(dev.row_src[~host.from_ring], host.row_src[~host.from_ring])
        written = dev.ring_dst != storage.scratch_window * cap
        assert torch.equal(dev.ring_dst[written], host.ring_dst) and torch.equal(dev.ring_rows[written], host.ring_rows)


def reference_plan(codec, cap, ps, items, pages):
    """The host write plan request by request, as ``CodedStorage.plan`` defines it: each request's open groups
    [old // g * g, ceil(new / g) * g), slots past its new rows repeating the last one, each from the ring (before
    ``old``) or from the step's rows; the new rows the window keeps ([max(quant_len(new), old), new)) into it."""
    g = codec.group
    out = {k: [] for k in ("from_ring", "ring_src", "row_src", "group_slots", "ring_dst", "ring_rows")}
    for i, (w, old, n, row0) in enumerate(items):
        new = old + n
        for s in range(old // g * g, -(-new // g) * g):
            p = min(s, new - 1)
            out["from_ring"].append(p < old)
            out["ring_src"].append(w * cap + p % cap)
            out["row_src"].append(max(row0 + p - old, 0))
            out["group_slots"].append(pages[i][s // ps] * ps + s % ps)
        for pos in range(max(codec.quant_len(new), old), new):
            out["ring_dst"].append(w * cap + pos % cap)
            out["ring_rows"].append(row0 + pos - old)
    return out


@pytest.mark.parametrize("cfg", [{"bits": 4, "group_size": 4, "residual": 8},
                                 {"bits": 2, "group_size": 8, "residual": 0},
                                 {"bits": 4, "group_size": 8, "residual": 16}])
def test_host_write_plan_equals_the_per_request_definition(cfg):
    """``plan_rows`` (numpy over every request of a step) equals the request-by-request definition on
    prefill chunks, decode rows, empty requests and requests that open a new page."""
    import random

    from engine.storage import CodedStorage
    from engine.storage.write_plans import plan_decode, plan_rows

    codec = create_kv_storage("kivi", cfg)
    ps, windows = 8, 6
    spec = CodedCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
                          page_size=ps, codec=codec, max_windows=windows)
    storage = CodedStorage(spec, num_pages=64)
    rng = random.Random(0)
    for trial in range(60):
        items, pages, row = [], [], 0
        for _ in range(rng.randrange(0, 6)):
            old = rng.randrange(0, 50)
            n = rng.choice([0, 1, 1, rng.randrange(1, 30)])
            items.append((rng.randrange(windows + 1), old, n, row))
            row += n
            pages.append([rng.randrange(1, 64) for _ in range(-(-(old + n + codec.group) // ps))])
        got = plan_rows(storage, items, pages)
        want = reference_plan(codec, storage.capacity, ps, items, pages)
        for name, values in want.items():
            assert getattr(got, name).tolist() == values, (trial, name, items)
