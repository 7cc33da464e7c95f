"""The benchmarks' counting rules, on the CPU.

- Decode tok/s counts only tokens produced inside the timed window: requests whose prompts finished in earlier
  chunks decode inside the later chunks (the scheduler serves running requests first), before t1; the count is
  checked against a log of every step's outputs and against the chunk pattern worked out by hand.
- A decode window launched before t0 (overlap_decode) is not counted: its device work is done by the sync.
- A graph replay is timed on a full bucket only: rows between a live batch and its bucket are padding.
- Figures are the median of repeats, with min and max; the serving benchmark's TTFT / TPOT from a synthetic
  step timeline equal a hand computation.
"""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.serving import RequestRecord, percentile, poisson_arrivals, record_outputs, summarize_requests
from engine import EngineConfig, LLMEngine, SamplingParams
from benchmarks.throughput import (FullBucketReplay, TimedTokens, aggregate_runs, is_full_bucket, replay_bucket, run_one,
                          with_spread, write_shape_dir)
from engine.cuda_graphs import DecodeGraphs


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory):
    return write_shape_dir("tiny", tmp_path_factory.mktemp("shape"))


def engine_for(model_dir, **options):
    config = dict(model=model_dir, load_format="dummy", dtype="float32", device="cpu", enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**config, **options}))


def logged_steps(engine):
    """Record every step's outputs as (request id, tokens returned) pairs."""
    log, inner = [], engine.step

    def step():
        outputs = inner()
        log.append([(o.request_id, len(o.new_token_ids)) for o in outputs])
        return outputs

    engine.step = step
    return log


def test_tokens_decoded_inside_later_prefill_chunks_are_not_counted(tiny_shape):
    """bs8 @ 4K with 16K-token chunks, scaled down 8x (8 @ 512, 2048-token chunks: the same pattern): chunk 1
    prefills requests 0-3; chunk 2 decodes them once and prefills 4-6 and most of 7; chunk 3 decodes 0-6 once
    and ends 7's prompt. 4 + 7 = 11 tokens decoded before t1; of 8 x (4 - 1) = 24 the old count, 13 remain."""
    engine = engine_for(tiny_shape, max_num_batched_tokens=2048, max_num_seqs=8, num_pages=8 * 40)
    log = logged_steps(engine)
    r = run_one(engine, batch=8, context=512, decode_tokens=4, seed=0)
    assert r["decode_tokens_before_t1"] == 11
    assert r["decode_tokens_counted"] == 13 != 8 * (4 - 1)
    # independently, from the step log: the tokens returned after the step that gave the last first token
    seen: dict[str, int] = {}
    t1_step = None
    for i, step in enumerate(log):
        for rid, n in step:
            seen[rid] = seen.get(rid, 0) + n
        if t1_step is None and len(seen) == 8:
            t1_step = i
    after = sum(n for step in log[t1_step + 1:] for _, n in step)
    before = sum(n for step in log[:t1_step + 1] for _, n in step)
    assert r["decode_tokens_counted"] == after and r["decode_tokens_before_t1"] == before - 8
    assert r["decode_tok_s"] * r["decode_step_ms"] * r["timed_decode_steps"] / 1e3 == pytest.approx(after)


def test_a_case_decoding_only_after_its_last_prompt_counts_every_later_token(tiny_shape):
    """One chunk holds every prompt: nothing decodes before t1, so the count is batch x (decode_tokens - 1)."""
    engine = engine_for(tiny_shape, max_num_batched_tokens=2048, max_num_seqs=4, num_pages=4 * 10)
    r = run_one(engine, batch=4, context=64, decode_tokens=5, seed=0)
    assert r["decode_tokens_before_t1"] == 0 and r["decode_tokens_counted"] == 4 * 4
    assert r["in_flight_tokens_excluded"] == 0 and r["graph_replay_rule"] == "no decode graphs"


def test_a_window_in_flight_at_t0_is_not_counted(tiny_shape):
    """With overlap_decode, the step after t0 returns the window launched before it (finished on the device by
    the sync): its tokens and its decode steps are excluded; every later step's tokens are counted."""
    engine = engine_for(tiny_shape, decode_steps=2, overlap_decode=True, max_num_seqs=2, num_pages=40)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(list(range(10 + i, 40 + i)), params) for i in range(2)]
    reqs = [engine._requests[i] for i in ids]
    while not engine._window_in_flight():
        engine.step()
    timed = TimedTokens(engine, reqs)
    timed.start()
    returned = [sum(len(o.new_token_ids) for o in engine.step())]
    assert timed.took() is False  # the pre-t0 window
    for _ in range(3):
        returned.append(sum(len(o.new_token_ids) for o in engine.step()))
        assert timed.took() is True
    assert timed.excluded == returned[0] == 2 * 2  # a window of 2 steps for 2 requests
    assert timed.count() == sum(returned[1:]) == 3 * 2 * 2
    while engine.has_unfinished():
        engine.step()


def test_sparse_decode_excludes_the_window_launched_before_its_timing():
    """benchmarks.sparse_decode with overlapped windows of one step: each timed window's first step takes the
    window launched before it; every request decodes once per counted step."""
    from benchmarks.sparse_decode import main

    (r,) = main(["--shape", "tiny", "--context", "128", "--window", "16", "--max-batch", "3", "--decode-steps",
                 "4", "--kv-bytes", "4000000", "--dtype", "float32", "--device", "cpu", "--methods", "dense",
                 "--overlap-decode", "on", "--repeats", "3"])
    assert r["overlap_decode"] is True and r["batch"] == 3 and r["repeats"] == 3
    assert r["in_flight_tokens_excluded"] == 3  # one step's token per request, in every repetition
    assert r["timed_steps"] == 4 and r["timed_tokens"] == 3 * 4  # not 3 x 5
    assert r["spread"]["decode_tok_s"]["min"] <= r["decode_tok_s"] <= r["spread"]["decode_tok_s"]["max"]


class FakeGraph:
    """A captured graph stand-in: its replay records the lengths the static buffers hold."""

    def __init__(self, graphs, bucket):
        self.graphs, self.bucket, self.seen = graphs, bucket, []

    def replay(self):
        self.seen.append(self.graphs.kv_lens[0, :self.bucket].tolist())


def cpu_graphs(buckets_up_to: int = 4) -> DecodeGraphs:
    cache = SimpleNamespace(spec=SimpleNamespace(num_layers=2, recurrent_layers=0), storage=None)  # dense: no codec or state
    runner = SimpleNamespace(device=torch.device("cpu"), cache=cache)
    g = DecodeGraphs(runner, max_batch=buckets_up_to, max_pages=8, scratch_page=0, page_size=16)
    for b in g.buckets:
        g.graphs[b] = FakeGraph(g, b)
        g.logits[b] = torch.zeros(b, 5)
    return g


def decode_batch(kv_lens: list[int]):
    n = len(kv_lens)
    view = SimpleNamespace(block_tables=torch.arange(n * 2, dtype=torch.int32).view(n, 2),
                           kv_lens=torch.tensor(kv_lens, dtype=torch.int32))
    return SimpleNamespace(num_tokens=n, input_ids=torch.ones(n, dtype=torch.int64),
                           positions=torch.tensor(kv_lens) - 1, slot_mapping=torch.arange(n), view=view,
                           layer_views=None)


def test_the_replay_timed_is_a_full_bucket_step_not_a_padded_one():
    assert replay_bucket([1, 2, 4, 8], 4) == 4 and replay_bucket([1, 2, 4, 8], 3) is None
    assert is_full_bucket((4, 4), 4) and not is_full_bucket((3, 4), 4) and not is_full_bucket((4, 4), None)
    g = cpu_graphs()
    replay = FullBucketReplay(g, batch=4)
    g.run(decode_batch([100, 100, 100, 100]))  # every row live: a full step of bucket 4
    replay.observe()
    g.run(decode_batch([101, 101, 101]))  # the tail: 3 live rows, one padding row reading one slot
    replay.observe()
    assert g.last_rows == (3, 4) and g.padded_replays == 1 and g.replays == 2
    assert g.kv_lens[0, :4].tolist() == [101, 101, 101, 1]  # what a replay timed now would read
    assert replay.time_ms(reps=3) is not None
    assert g.graphs[4].seen[-3:] == [[100, 100, 100, 100]] * 3  # the kept full step, not the padded one
    assert replay.rule().startswith("timed on a full bucket")


def test_a_batch_that_is_no_bucket_or_never_fills_it_times_no_replay():
    g = cpu_graphs()
    replay = FullBucketReplay(g, batch=3)  # buckets 1, 2, 4: every step of 3 rows pads one
    g.run(decode_batch([50, 50, 50]))
    replay.observe()
    assert replay.time_ms() is None and "not a graph bucket" in replay.rule()
    replay = FullBucketReplay(g, batch=4)
    g.run(decode_batch([50, 50, 50]))
    replay.observe()
    assert replay.time_ms() is None and "no timed step replayed a full bucket" in replay.rule()
    assert FullBucketReplay(None, 4).rule() == "no decode graphs"


def test_repeats_aggregate_to_median_with_min_and_max():
    runs = [{"decode_tok_s": 10.0, "steps": 8, "phase": {"a": 1.0}, "name": "x", "replay": None},
            {"decode_tok_s": 30.0, "steps": 8, "phase": {"a": 3.0}, "name": "x", "replay": None},
            {"decode_tok_s": 12.0, "steps": 8, "phase": {"a": 2.0}, "name": "x", "replay": None}]
    r = aggregate_runs(runs)
    assert r["decode_tok_s"] == 12.0 and r["spread"]["decode_tok_s"] == {"min": 10.0, "max": 30.0}
    assert r["steps"] == 8 and isinstance(r["steps"], int)
    assert r["phase"] == {"a": 2.0} and r["spread"]["phase"] == {"a": {"min": 1.0, "max": 3.0}}
    assert r["name"] == "x" and r["replay"] is None and r["repeats"] == 3
    assert with_spread(r, "decode_tok_s") == "12.0 [10.0-30.0]" and with_spread(r, "steps", "d") == "8"
    even = aggregate_runs(runs[:2])
    assert even["decode_tok_s"] == 20.0 and even["repeats"] == 2


def test_engine_bench_reports_the_median_of_its_repeats():
    from benchmarks.throughput import main

    (r,) = main(["--shape", "tiny", "--cases", "2@32", "--decode-tokens", "4", "--device", "cpu", "--dtype",
                 "float32", "--repeats", "3"])
    s = r["spread"]["decode_tok_s"]
    assert r["repeats"] == 3 and s["min"] <= r["decode_tok_s"] <= s["max"]
    assert r["decode_tokens_counted"] == 2 * 3 and r["spread"]["decode_tokens_counted"] == {"min": 6, "max": 6}


def step_out(rid, n, finished=False):
    return SimpleNamespace(request_id=rid, new_token_ids=[7] * n, finished=finished)


def test_serving_ttft_and_tpot_from_a_synthetic_step_timeline():
    """Three requests, arriving at 0.0, 0.5 and 1.0 s; the steps come back at the times below (a window of
    decode steps returns several tokens at once)."""
    records = {"a": RequestRecord("a", 0.0, admitted=0.0), "b": RequestRecord("b", 0.5, admitted=0.6),
               "c": RequestRecord("c", 1.0, admitted=1.0)}
    timeline = [
        (1.0, [step_out("a", 1)]),                                   # a's first token
        (1.5, [step_out("a", 1), step_out("b", 1)]),                 # b's first token
        (2.0, [step_out("a", 2, True), step_out("b", 2)]),           # a done: 4 tokens
        (3.0, [step_out("b", 1, True), step_out("c", 1)]),           # b done: 4 tokens; c's first
        (3.5, [step_out("c", 1, True)]),                             # c done: 2 tokens
    ]
    finished = []
    for t, outs in timeline:
        finished += record_outputs(records, outs, t)
    assert finished == ["a", "b", "c"]
    # TTFT: a 1.0, b 1.0, c 2.0; TPOT: a (2.0 - 1.0) / 3, b (3.0 - 1.5) / 3 = 0.5, c (3.5 - 3.0) / 1 = 0.5
    assert [records[k].ttft for k in "abc"] == [1.0, 1.0, 2.0]
    assert [records[k].tpot for k in "abc"] == pytest.approx([1 / 3, 0.5, 0.5])
    s = summarize_requests(list(records.values()))
    assert s["ttft_ms_p50"] == pytest.approx(1000.0)
    assert s["ttft_ms_p99"] == pytest.approx(1000.0 + 0.98 * 1000.0)  # position 1.98 of [1000, 1000, 2000]
    assert s["tpot_ms_p50"] == pytest.approx(500.0) and s["tpot_ms_p99"] == pytest.approx(500.0)
    assert s["duration_s"] == 3.5 and s["completed"] == 3
    assert s["request_throughput"] == pytest.approx(3 / 3.5) and s["output_tok_s"] == pytest.approx(10 / 3.5)
    assert s["admission_wait_ms_p50"] == pytest.approx(0.0) and s["admission_wait_ms_p99"] == pytest.approx(98.0)


def test_percentiles_and_arrivals():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    import random

    assert poisson_arrivals(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    times = poisson_arrivals(2000, 4.0, random.Random(0))
    assert times == sorted(times) and times[-1] / 2000 == pytest.approx(0.25, rel=0.1)
