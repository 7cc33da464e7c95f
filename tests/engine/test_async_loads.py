"""Asynchronous chain loads (``EngineConfig.chain_async_loads``, engine.async_loads): a turn whose chain is in the
host tier starts its copy and waits parked, while other requests run, until the copy is done (a turn parked for
room starts it when room appears); the step's stream is ordered after the copy before the turn runs; with nothing else to run it goes at once; an aborted turn settles the
copy and leaves its chain resident. On a CPU the copy is synchronous, so a stand-in copy in flight (done after a
number of polls) is put on the loaded table; its pages are already in place. Reference: the same turn on an engine
whose chain never left the device (tokens equal, logprobs within fp32 noise of a different batch composition)."""

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.chain_tiers import ChainTiers
from tests.chain_helpers import finish, random_tokens, run_chain_turn

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
OTHER = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class CopyInFlight:
    """Stands in for ``engine.async_loads.PendingCopy``: done after ``polls`` calls of ``done``."""

    def __init__(self, polls: int):
        self.polls, self.settled = polls, 0

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def settle(self) -> None:
        self.settled += 1


def engine(model_dir, num_pages=400, **options):
    return LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=4, num_pages=num_pages,
                                  max_num_batched_tokens=64, **options))


def copies_in_flight(monkeypatch, polls):
    """Loads asked to be asynchronous leave a ``CopyInFlight`` of ``polls["n"]`` polls on their table; the
    returned list gets each."""
    copies = []
    load = ChainTiers.load

    def load_in_flight(self, entry, asynchronous=False):
        table = load(self, entry)
        if table is not None and asynchronous:
            table.ready = CopyInFlight(polls["n"])
            copies.append(table.ready)
        return table

    monkeypatch.setattr(ChainTiers, "load", load_in_flight)
    return copies


def record_plans(eng, copies) -> list:
    """(request ids of each step, the first copy's polls left when the step was planned), step by step."""
    plans = []
    schedule = eng.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append(([r.request_id for r in plan.requests], copies[0].polls if copies else None))
        return plan

    eng.scheduler.schedule = recorded
    return plans


@pytest.fixture
def setup(tiny_dirs, monkeypatch):
    """An engine with a host tier and asynchronous loads whose loads leave a ``CopyInFlight`` on the table (the
    list ``copies`` gets each), its chain "a" moved to the host tier, the next turn's prompt; the reference."""
    polls = {"n": 3}
    copies = copies_in_flight(monkeypatch, polls)
    rng = random.Random(5)
    first = random_tokens(rng, 40)
    eng = engine(tiny_dirs["qwen3"], chain_host_bytes=64 * 2**20, chain_async_loads=True)
    ref = engine(tiny_dirs["qwen3"])
    out = run_chain_turn(eng, "a", first, PARAMS)
    assert out.token_ids == run_chain_turn(ref, "a", first, PARAMS).token_ids
    assert eng.release_chain("a") and eng.chain_info("a").status == "host"
    prompt = first + out.token_ids + random_tokens(rng, 9)
    return eng, ref, prompt, random_tokens(rng, 30), copies, polls


def check_equal(out, ref):
    assert out.token_ids == ref.token_ids
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert out.num_prefilled_tokens == ref.num_prefilled_tokens


def test_a_turn_waits_parked_while_its_chain_copies_in_and_others_run(setup):
    eng, ref, prompt, other, copies, _ = setup
    plans = record_plans(eng, copies)
    other_id = eng.add_request(other, OTHER)
    eng.step()
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    assert eng._requests[rid].parked and len(copies) == 1
    out = finish(eng, rid)
    first = next(i for i, (ids, _) in enumerate(plans) if rid in ids)
    # not admitted while its copy was in flight, though the other request ran in those steps
    assert all(polls >= 0 for _, polls in plans[1:first]) and plans[first][1] < 0
    assert all(other_id in ids for ids, _ in plans[1:first]) and first > 1
    assert copies[0].settled == 1 and eng.chains.index.get("a").table.ready is None
    assert eng.chains.tiers.counters.seconds["load_wait"] > 0 and not eng.chains._loading_since
    assert out.resume_status == "loaded"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))


def test_a_turn_parked_for_room_starts_its_copy_when_room_appears_and_waits_for_it(tiny_dirs, monkeypatch):
    """A 40-page pool: a stateless request of 31 pages and a small one decoding leave no room for the chain's 20
    pages, so the turn parks without a copy; when the big one finishes, the copy starts and the turn waits for
    it while the small one goes on decoding."""
    copies = copies_in_flight(monkeypatch, {"n": 3})
    rng = random.Random(3)
    first = random_tokens(rng, 72)
    eng = engine(tiny_dirs["qwen3"], num_pages=40, chain_host_bytes=64 * 2**20, chain_async_loads=True)
    ref = engine(tiny_dirs["qwen3"])
    out = run_chain_turn(eng, "a", first, PARAMS)
    run_chain_turn(ref, "a", first, PARAMS)
    prompt = first + out.token_ids + random_tokens(rng, 10)
    eng.chains.memory.reclaim(eng.pool.num_pages)
    big = eng.add_request(random_tokens(rng, 120), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    small = eng.add_request(random_tokens(rng, 6), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    assert eng._requests[rid].parked and not copies  # no room yet: parked with its chain in the tier
    plans = record_plans(eng, copies)
    got = finish(eng, rid)
    started = next(i for i, (_, polls) in enumerate(plans) if polls is not None)
    admitted = next(i for i, (ids, _) in enumerate(plans) if rid in ids)
    assert all(big not in ids for ids, _ in plans[started:])  # the copy started once the big one was done
    assert admitted > started and plans[admitted][1] < 0
    assert all(small in ids and rid not in ids for ids, _ in plans[started:admitted])
    assert copies[0].settled == 1 and got.resume_status == "loaded"
    check_equal(got, run_chain_turn(ref, "a", prompt, PARAMS))


def test_with_nothing_else_to_run_the_turn_goes_at_once(setup):
    eng, ref, prompt, _, copies, polls = setup
    polls["n"] = 10**9  # never done: the turn must not wait for it with an idle engine
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    out = finish(eng, rid)
    assert copies[0].settled == 1 and out.resume_status == "loaded"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))


def test_an_aborted_turn_settles_the_copy_and_its_chain_stays_resident(setup):
    eng, ref, prompt, other, copies, polls = setup
    polls["n"] = 10**9
    other_id = eng.add_request(other, OTHER)
    eng.step()
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    eng.step()
    assert eng._requests[rid].parked
    eng.abort(rid)
    assert copies[0].settled == 1 and eng.chain_info("a").status == "idle"
    finish(eng, other_id)
    out = run_chain_turn(eng, "a", prompt, PARAMS)
    assert out.resume_status == "resumed"
    check_equal(out, run_chain_turn(ref, "a", prompt, PARAMS))


def test_on_a_cpu_the_load_is_done_when_it_returns(tiny_dirs):
    """Without the stand-in: the CPU copies synchronously, so the turn binds at once and loads."""
    rng = random.Random(6)
    first = random_tokens(rng, 40)
    eng = engine(tiny_dirs["qwen3"], chain_host_bytes=64 * 2**20, chain_async_loads=True)
    ref = engine(tiny_dirs["qwen3"])
    out = run_chain_turn(eng, "a", first, PARAMS)
    run_chain_turn(ref, "a", first, PARAMS)
    assert eng.release_chain("a")
    prompt = first + out.token_ids + random_tokens(rng, 9)
    rid = eng.add_request(prompt, PARAMS, chain_id="a")
    assert not eng._requests[rid].parked
    got = finish(eng, rid)
    assert got.resume_status == "loaded"
    check_equal(got, run_chain_turn(ref, "a", prompt, PARAMS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")
def test_on_a_gpu_the_side_stream_copy_lands_after_work_queued_before_it():
    """Pages a step still writes when the copy starts (a long kernel queued first) end with the copied bytes;
    after ``settle`` the step's stream reads them."""
    from engine.async_loads import SideStreamCopier

    pages = torch.zeros(64, 16, 8, device="cuda")
    host = torch.randn(3, 16, 8).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queued ahead of the copy on the step's stream, writing page 5 last
        busy = busy @ busy / 4096
    pages[5] = busy[:16, :8]
    copy = SideStreamCopier().copy_in([(pages, 0)], [5, 9, 2], [host])
    copy.settle()
    got = pages[[5, 9, 2]].cpu()  # on the step's stream, after the copy
    assert torch.equal(got, host)
    torch.cuda.synchronize()
    assert copy.done()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")
def test_on_a_gpu_starting_a_load_leaves_the_host_free_of_queued_steps():
    """``copy_in`` returns while the steps queued before it still run: the host waits for none of them."""
    from engine.async_loads import SideStreamCopier

    pages = torch.zeros(64, 16, 8, device="cuda")
    host = torch.randn(3, 16, 8).pin_memory()
    copier = SideStreamCopier()
    copier.copy_in([(pages, 0)], [1, 2, 3], [host]).settle()  # the side stream made once
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a long step queued on the step's stream
    queued = torch.cuda.Event()
    queued.record()
    copy = copier.copy_in([(pages, 0)], [5, 9, 2], [host])
    assert not queued.query()  # still running: copy_in did not wait for it
    copy.settle()
    assert torch.equal(pages[[5, 9, 2]].cpu(), host)
