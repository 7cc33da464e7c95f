"""Host copies made at a turn's end (engine.host_copies): a reclaim takes the copy of the chain's pages instead of
copying them on the step's path, only while the table is as it was copied; any change in between (the next turn,
a rewind, a prune) discards it, so a reclaim copies afresh. Checked against a chain that never left the device
(greedy tokens and logprobs) and against the pages themselves. On a GPU the copies run on a side stream (the GPU
suite); here they are made synchronously (``HostCopies.enabled`` forced on)."""

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.host_copies import signature
from tests.chain_helpers import random_tokens, run_chain_turn

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)


def engine(model_dir, **options):
    return LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=4, num_pages=400,
                                  max_num_batched_tokens=64, **options))


@pytest.fixture
def engines(tiny_dirs):
    model_dir = tiny_dirs["qwen3"]
    eng = engine(model_dir, chain_host_bytes=64 * 2**20)
    eng.chains.tiers.copies.enabled = True
    return eng, engine(model_dir)


def turn(eng, ref, rng, new=6):
    prompt = eng.chains.index.get("c").token_ids + random_tokens(rng, new)
    out, want = run_chain_turn(eng, "c", prompt, PARAMS), run_chain_turn(ref, "c", prompt, PARAMS)
    assert out.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, want.logprobs)) < 1e-5
    return out


def pages_of(eng, chain_id):
    table = eng.chains.index.get(chain_id).table
    return [t.index_select(dim, torch.tensor(table.pages, device=t.device)).clone()
            for t, dim in eng.cache.storage.page_tensors()]


def test_a_reclaim_takes_the_copy_made_at_the_turns_end(engines):
    eng, ref = engines
    copies, rng = eng.chains.tiers.copies, random.Random(3)
    for e in (eng, ref):
        run_chain_turn(e, "c", random_tokens(rng.__class__(1), 30), PARAMS)
    assert "c" in copies.copies and eng.chains.tiers.counters.copies_made == 1 and copies.nbytes > 0
    want = pages_of(eng, "c")
    assert all(torch.equal(a, b) for a, b in zip(copies.copies["c"].pages, want))
    assert eng.release_chain("c") and eng.chain_info("c").status == "host"  # what pressure does
    assert eng.chains.tiers.counters.copies_taken == 1 and not copies.copies and copies.nbytes == 0
    entry = eng.chains.index.get("c").offloaded
    assert all(torch.equal(a, b) for a, b in zip(entry.pages, want))
    out = turn(eng, ref, rng)
    assert out.resume_status == "loaded"
    assert "c" in copies.copies and eng.chains.tiers.counters.copies_made == 2  # this turn's end copied again


@pytest.mark.parametrize("change", ["turn", "rewind", "prune"])
def test_a_copy_of_a_table_that_changed_since_is_not_taken(engines, change):
    eng, ref = engines
    copies, rng = eng.chains.tiers.copies, random.Random(5)
    for e in (eng, ref):
        run_chain_turn(e, "c", random_tokens(random.Random(2), 40), PARAMS)
    stale = copies.copies["c"]
    if change == "turn":  # its start discards the copy; its end makes a new one of the longer table
        turn(eng, ref, rng)
        assert copies.copies["c"] is not stale
        assert copies.copies["c"].signature != stale.signature
        copies.copies["c"] = stale  # as if the turn had not discarded it: the signature still refuses it
    else:
        for e in (eng, ref):
            if change == "rewind":
                e.rewind_chain("c", 30)
            else:
                e.prune_chain("c", [(8, 16)])
        assert "c" not in copies.copies
        copies.copies["c"] = stale
    copies.nbytes += stale.nbytes
    assert stale.signature != signature(eng.chains.index.get("c").table)
    want = pages_of(eng, "c")
    assert eng.release_chain("c")
    assert eng.chains.tiers.counters.copies_taken == 0  # the stale copy was not taken: the pages were copied afresh
    entry = eng.chains.index.get("c").offloaded
    assert all(torch.equal(a, b) for a, b in zip(entry.pages, want))
    assert turn(eng, ref, rng).resume_status == "loaded"


def test_copies_take_only_room_the_host_tier_has_and_leave_first(tiny_dirs):
    eng = engine(tiny_dirs["qwen3"], chain_host_bytes=1)
    eng.chains.tiers.copies.enabled = True
    run_chain_turn(eng, "c", random_tokens(random.Random(1), 30), PARAMS)
    assert not eng.chains.tiers.copies.copies  # no room: not made

    eng = engine(tiny_dirs["qwen3"], chain_host_bytes=64 * 2**20)
    tiers = eng.chains.tiers
    tiers.copies.enabled = True
    for chain_id in ("a", "b"):
        run_chain_turn(eng, chain_id, random_tokens(random.Random(len(chain_id)), 30), PARAMS)
    assert set(tiers.copies.copies) == {"a", "b"}
    per_chain = tiers.copies.copies["a"].nbytes
    tiers.host_bytes = tiers.host_used + per_chain + per_chain // 2  # a's entry fits, b's copy beside it does not
    assert eng.release_chain("a") and tiers.counters.copies_taken == 1  # a's copy taken; b's discarded to make room
    assert "b" not in tiers.copies.copies and tiers.copies.nbytes == 0
    eng.delete_chain("a")
    run_chain_turn(eng, "b", eng.chains.index.get("b").token_ids + [5, 6], PARAMS)
    assert "b" in tiers.copies.copies
    eng.delete_chain("b")
    assert not tiers.copies.copies and tiers.copies.nbytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a GPU")
def test_on_a_gpu_the_copy_runs_on_a_side_stream_and_a_reclaim_takes_it(tiny_dirs):
    """Copies turned on (``chain_host_copies``) on a GPU: made at a turn's end (pinned host memory, recorded on
    an event); the chain released, then its next turn loaded, gives the tokens of a chain that never left the
    device."""
    def gpu_engine(**options):
        return LLMEngine(EngineConfig(tiny_dirs["qwen3"], dtype="float32", device="cuda", page_size=16,
                                      num_pages=256, max_num_batched_tokens=64, **options))

    eng, ref = gpu_engine(chain_host_bytes=64 * 2**20, chain_host_copies=True), gpu_engine()
    copies, rng = eng.chains.tiers.copies, random.Random(4)
    assert copies.enabled
    for e in (eng, ref):
        run_chain_turn(e, "c", random_tokens(random.Random(1), 50), PARAMS)
    copy = copies.copies["c"]
    assert copy.done is not None and all(p.is_pinned() for p in copy.pages)
    want = [p.cpu() for p in pages_of(eng, "c")]
    assert eng.release_chain("c") and eng.chains.tiers.counters.copies_taken == 1
    assert all(torch.equal(a, b) for a, b in zip(eng.chains.index.get("c").offloaded.pages, want))
    assert turn(eng, ref, rng).resume_status == "loaded"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a GPU")
def test_on_a_gpu_making_a_copy_leaves_the_host_free_of_queued_steps():
    """``make`` queues the copy behind the steps in flight and returns while they still run (the host never waits
    for the step's stream), and the copy holds the pages as those steps left them."""
    from types import SimpleNamespace

    from engine.host_copies import HostCopies

    pages = torch.randn(64, 16, 8, device="cuda")
    copies = HostCopies(SimpleNamespace(storage=SimpleNamespace(page_tensors=lambda: [(pages, 0)])), enabled=True)

    def table(ids):
        return SimpleNamespace(pages=ids, num_slots=16 * len(ids), layer_lens=None, compacted_at=None)

    assert copies.make("warm", table([1, 2]), room=1 << 30)  # the side stream and pinned buffers made once
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a long step queued on the step's stream
    pages[5] = 7.0  # written by the step's stream after it
    queued = torch.cuda.Event()
    queued.record()
    assert copies.make("c", table([5, 9, 2]), room=1 << 30)
    assert not queued.query()  # the queued work is still running: make did not wait for it
    copy = copies.copies["c"]
    copy.done.synchronize()
    assert torch.equal(copy.pages[0], pages[[5, 9, 2]].cpu()) and bool((copy.pages[0][0] == 7.0).all())
