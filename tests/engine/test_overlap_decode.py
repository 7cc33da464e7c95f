"""Overlapped decode windows (``EngineConfig.overlap_decode``): the next window is launched before the host
reads the current one. tests/engine/test_decode_steps.py runs every window test both ways; here what only the
overlapped engine does: a step that returns nothing while its window runs, a request aborted or joining while
a window is in flight, a launch that fails, and the knob's validation.

Reference: the same requests through the engine with ``decode_steps=1`` (which the engine tests check against
HF transformers), and exact page counts.
"""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.decode_window import DecodeWindows
from engine.errors import ConfigError
from engine.model_runner import ModelRunner

COMMON = dict(dtype="float32", device="cpu", page_size=4)


def prompts(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=True)


def reference(model_dir, items):
    engine = LLMEngine(EngineConfig(model_dir, **COMMON))
    ids = [engine.add_request(p, sp) for p, sp in items]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].token_ids for i in ids]


def finish_through_faults(engine):
    """Step until done, counting the steps that raise (a fault leaves no window in flight)."""
    done, errors = {}, 0
    while engine.has_unfinished():
        try:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        except RuntimeError:
            errors += 1
            assert engine.windows.pending is None
    return done, errors


def overlapped(model_dir, k=4, **options):
    return LLMEngine(EngineConfig(model_dir, decode_steps=k, overlap_decode=True, **COMMON, **options))


def test_overlapped_windows_are_counted_exactly(tiny_dirs, monkeypatch):
    """The step that launches the first window returns nothing and times nothing; each later step launches
    the next window, then returns the previous one's tokens (StepTiming.overlapped); the last window has no
    successor (the lengths are known), so no window is computed past max_tokens."""
    engine = overlapped(tiny_dirs["qwen3"], max_num_batched_tokens=64)
    rid = engine.add_request(prompts(0, (20,))[0], greedy(14))
    seen, calls = [], []
    inner = ModelRunner.execute_decode_steps

    def counting(self, batch, k, ahead=0):
        calls.append((k, ahead))
        return inner(self, batch, k, ahead)

    monkeypatch.setattr(ModelRunner, "execute_decode_steps", counting)
    while engine.has_unfinished():
        outs = engine.step()
        t = engine.last_step
        seen.append((len(outs[0].new_token_ids) if outs else 0,
                     None if t is None else (t.kind, t.decode_steps, t.overlapped)))
    # the prompt (one step, the first token), then 13 tokens: windows of 4, 4, 4 and 1
    assert seen == [(1, ("prefill", 1, False)), (0, None), (4, ("decode-eager", 4, True)),
                    (4, ("decode-eager", 4, True)), (4, ("decode-eager", 4, True)), (1, ("decode-eager", 1, False))]
    assert calls == [(4, 0), (4, 4), (4, 4), (1, 4)]
    assert rid not in engine._requests and all(r == 0 for r in engine.pool.ref_counts)


def test_a_stop_inside_a_window_drops_the_window_after_it(tiny_dirs):
    """A request that stops in window N had window N + 1 launched for it: its tokens are dropped, the other
    requests keep theirs, and every page comes back."""
    ps = prompts(1, (13, 29))
    (free, other) = reference(tiny_dirs["llama"], [(ps[0], greedy(20)), (ps[1], greedy(20))])
    stop = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[free[6]])
    engine = overlapped(tiny_dirs["llama"])
    ids = [engine.add_request(ps[0], stop), engine.add_request(ps[1], greedy(20))]
    done, dropped = {}, []
    while engine.has_unfinished():
        window = engine.windows.pending
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if window is not None and window.requests[0].is_finished and engine.windows.pending is not None:
            dropped.append(engine.windows.pending.requests[0].request_id)  # launched for a request that had stopped
    assert done[ids[0]].token_ids == free[:free.index(free[6]) + 1]
    assert done[ids[1]].token_ids == other
    assert dropped == [ids[0]]
    assert all(r == 0 for r in engine.pool.ref_counts)


def test_abort_and_a_new_request_while_a_window_is_in_flight(tiny_dirs):
    """An abort between steps takes the request out of the window in flight (it takes nothing more); a request
    added meanwhile ends the overlapping (it is admitted after the window is read) and the others go on."""
    ps = prompts(2, (11, 19, 7))
    ref = reference(tiny_dirs["qwen3"], [(p, greedy(18)) for p in ps])
    engine = overlapped(tiny_dirs["qwen3"])
    a, b = engine.add_request(ps[0], greedy(18)), engine.add_request(ps[1], greedy(18))
    streamed = {a: [], b: []}
    aborted = None
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 3:
            assert engine.windows.pending is not None
            aborted = engine.abort(a)
            c = engine.add_request(ps[2], greedy(18))
            streamed[c] = []
    assert aborted.finished and aborted.finish_reason == "abort"
    assert streamed[a] == aborted.token_ids == ref[0][:len(aborted.token_ids)]
    assert streamed[b] == ref[1] and streamed[c] == ref[2]
    assert all(r == 0 for r in engine.pool.ref_counts)


def test_a_launch_that_fails_loses_no_token(tiny_dirs, monkeypatch):
    """The next window's launch raises: the step fails, the window it was to follow is dropped untaken, and
    the requests go on from the tokens the host holds, to the same outputs."""
    ps = prompts(3, (9, 21))
    ref = reference(tiny_dirs["qwen3"], [(p, greedy(16)) for p in ps])
    engine = overlapped(tiny_dirs["qwen3"])
    ids = [engine.add_request(p, greedy(16)) for p in ps]
    inner, failed = ModelRunner.execute_decode_steps, []

    def failing(self, batch, k, ahead=0):
        if ahead and not failed:
            failed.append(k)
            raise RuntimeError("device fault")
        return inner(self, batch, k, ahead)

    monkeypatch.setattr(ModelRunner, "execute_decode_steps", failing)
    done, errors = finish_through_faults(engine)
    assert errors == 1 and failed
    assert [done[i].token_ids for i in ids] == ref


def test_bad_values(tiny_dirs):
    with pytest.raises(ConfigError, match="overlap_decode must be"):
        EngineConfig(tiny_dirs["qwen3"], overlap_decode="yes")
    with pytest.raises(ConfigError, match="overlap_decode needs tensor_parallel_size 1"):
        EngineConfig(tiny_dirs["qwen3"], overlap_decode=True, tensor_parallel_size=2)
    for k in (1, 4):
        cfg = EngineConfig(tiny_dirs["qwen3"], decode_steps=k)
        assert cfg.resolved_overlap_decode(torch.device("cuda"), 1) is True
        assert cfg.resolved_overlap_decode(torch.device("cpu"), 1) is False
        assert cfg.resolved_overlap_decode(torch.device("cuda"), 2) is False
    assert EngineConfig(tiny_dirs["qwen3"], overlap_decode=False).resolved_overlap_decode(torch.device("cuda"), 1) is False


def test_the_switch_between_windows(tiny_dirs):
    """``LLMEngine.overlap_decode`` turns on and off between windows (benchmarks time both in one engine), not
    while one is in flight."""
    engine = overlapped(tiny_dirs["qwen3"])
    engine.add_request(prompts(4, (10,))[0], greedy(12))
    engine.step()  # the prompt
    engine.step()  # the first window, launched
    with pytest.raises(ConfigError, match="while a decode window is in flight"):
        engine.overlap_decode = False
    while engine.has_unfinished():
        engine.step()
    engine.overlap_decode = False
    engine.add_request(prompts(4, (10,))[0], greedy(12))
    engine.step()
    engine.step()
    assert engine.windows.pending is None and engine.last_step.decode_steps == 4 and not engine.last_step.overlapped


def test_a_take_that_fails_drops_the_window_launched_after_it(tiny_dirs, monkeypatch):
    """Taking a window's tokens raises after the next window was launched: that one follows tokens the host
    never took, so it is dropped too, and the requests go on from the host's tokens to the same outputs."""
    ps = prompts(5, (12, 17))
    ref = reference(tiny_dirs["qwen3"], [(p, greedy(16)) for p in ps])
    engine = overlapped(tiny_dirs["qwen3"])
    ids = [engine.add_request(p, greedy(16)) for p in ps]
    inner, failed = DecodeWindows.take, []

    def failing(self, window, *args, **kw):
        if self.pending is not None and not failed:
            failed.append(window.k)
            raise RuntimeError("host fault")
        return inner(self, window, *args, **kw)

    monkeypatch.setattr(DecodeWindows, "take", failing)
    done, errors = finish_through_faults(engine)
    assert errors == 1 and failed
    assert [done[i].token_ids for i in ids] == ref


def test_aborting_every_request_of_the_window_in_flight(tiny_dirs):
    """With every request of the window in flight aborted, the engine is idle: the window is not waited on
    nor counted, and the next request runs as on a fresh engine."""
    ps = prompts(6, (10, 14))
    ref = reference(tiny_dirs["qwen3"], [(ps[1], greedy(9))])
    engine = overlapped(tiny_dirs["qwen3"])
    ids = [engine.add_request(p, greedy(30)) for p in ps[:1]]
    engine.step()
    engine.step()
    assert engine.windows.pending is not None
    engine.abort(ids[0])
    assert not engine.has_unfinished()
    engine.overlap_decode = True  # no window in flight any more (a benchmark switches modes here)
    rid = engine.add_request(ps[1], greedy(9))
    first = engine.step()
    assert engine.last_step.kind == "prefill" and [o.request_id for o in first] == [rid]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid].token_ids == ref[0]
    assert all(r == 0 for r in engine.pool.ref_counts)



def _plans(seed):
    """Five requests: prompt, max_tokens, a stop token or none, when it arrives (tokens the client has seen),
    after how many of its tokens the client aborts it (or never)."""
    import random

    rng = random.Random(seed)
    ps = prompts(100 + seed, [rng.randrange(5, 40) for _ in range(5)])
    return [(p, rng.randrange(6, 24), rng.random() < 0.5, rng.randrange(0, 30) if i else 0,
             rng.randrange(3, 20) if rng.random() < 0.3 else None) for i, p in enumerate(ps)]


def _run_scenario(engine, plans, free):
    """Requests arriving and aborted on what the client has seen, as a server's clients do. Returns each
    request's final (tokens, finish reason), and how many windows were taken overlapped."""
    seen, ids, final, overlapped = 0, {}, {}, 0
    while len(final) < len(plans):
        for i, (p, max_tokens, stops, arrive, _) in enumerate(plans):
            if i not in ids and seen >= arrive:
                stop = [free[i][len(free[i]) // 2]] if stops else []
                ids[i] = engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                              stop_token_ids=stop))
        for i, (*_, abort_at) in enumerate(plans):
            req = engine._requests.get(ids.get(i))
            if req is not None and abort_at is not None and req.num_output_tokens >= abort_at:
                out = engine.abort(ids[i])
                final[i] = (out.token_ids, out.finish_reason)
        for o in engine.step():
            seen += len(o.new_token_ids)
            if o.finished:
                final[next(i for i, r in ids.items() if r == o.request_id)] = (o.token_ids, o.finish_reason)
        overlapped += engine.last_step is not None and engine.last_step.overlapped
    assert all(r == 0 for r in engine.pool.ref_counts)
    return [final[i] for i in range(len(plans))], overlapped


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_stops_and_aborts_match_single_steps(tiny_dirs, seed):
    """Under client events keyed to what the client has seen (arrivals, aborts), overlapped windows of 4 and
    of 1 (single steps, each launched before the last is read), serial windows of 4 and single steps give every
    request that is not aborted the same tokens and finish reason, and an aborted one a prefix of its free run
    at least as long as the client waited for."""
    plans = _plans(seed)
    free = reference(tiny_dirs["qwen3"], [(p, greedy(n)) for p, n, *_ in plans])
    results = []
    for overlap, k in ((False, 1), (False, 4), (True, 4), (True, 1)):
        engine = LLMEngine(EngineConfig(tiny_dirs["qwen3"], decode_steps=k, overlap_decode=overlap, **COMMON))
        outcome, overlapped = _run_scenario(engine, plans, free)
        assert (overlapped > 0) is overlap
        results.append(outcome)
    for i, (*_, abort_at) in enumerate(plans):
        outcomes = [r[i] for r in results]
        if abort_at is None or all(reason != "abort" for _, reason in outcomes):
            assert all(o == outcomes[0] for o in outcomes[1:])
        else:
            for tokens, reason in outcomes:
                assert tokens == free[i][:len(tokens)]
                assert reason != "abort" or len(tokens) >= abort_at


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_overlapped_single_steps_stream_one_token_a_step(tiny_dirs, arch):
    """``decode_steps=1`` with ``overlap_decode``: each decode step is launched before the last one is read, so
    the deltas stay one token long and the tokens and log-probabilities equal plain single steps'."""
    ps = prompts(7, (11, 26, 5))
    params = [greedy(n) for n in (9, 4, 13)]
    serial = LLMEngine(EngineConfig(tiny_dirs[arch], overlap_decode=False, **COMMON))
    engine = LLMEngine(EngineConfig(tiny_dirs[arch], overlap_decode=True, **COMMON))
    outs = []
    for e in (serial, engine):
        ids = [e.add_request(p, sp) for p, sp in zip(ps, params)]
        done, overlapped = {}, 0
        while e.has_unfinished():
            step = e.step()
            assert all(len(o.new_token_ids) <= 1 for o in step)
            overlapped += e.last_step is not None and e.last_step.overlapped
            done.update({o.request_id: o for o in step if o.finished})
        outs.append(([done[i] for i in ids], overlapped))
    (ref, none), (got, some) = outs
    assert none == 0 and some > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(ref, got):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-6)
