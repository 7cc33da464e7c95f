"""Agent-trace replay: the trace format, the synthetic generator, and a CPU replay on the tiny model where
Chain Cache prefills far fewer tokens than a stateless client on a server without a prefix cache."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from agentrt.replay import trace as tr
from agentrt.replay.synth import SynthShape, SynthShapeError, synth_trace


@pytest.fixture(scope="module")
def tokenizer():
    from engine.llm_engine import load_tokenizer
    from engine.tiny_checkpoint import random_model_dir

    tok = load_tokenizer(random_model_dir())
    tok.model_max_length = 2**62
    return tok


SMALL = SynthShape(num_turns=(5, 7), system_tokens=150, task_tokens=(10, 20), tool_tokens=(30, 90),
                   output_tokens=(56, 72), think_time_s=(0.1, 0.4))  # the tiny tokenizer: a call is <= 53


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_trace_round_trips_and_bad_lines_name_line_and_field(tokenizer, tmp_path):
    trace = synth_trace(tokenizer, 3, SMALL, vocab_size=len(tokenizer))
    path = tr.write(trace, tmp_path / "t.jsonl")
    assert tr.load(path) == trace
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1 + trace.num_turns
    assert msgspec.json.decode(lines[0])["type"] == "header"

    bad = msgspec.json.decode(lines[2])
    bad["output_token_ids"][1] = "x"
    with pytest.raises(tr.TraceError, match=r"t.jsonl:3: .*`\$\.output_token_ids\[1\]`"):
        tr.loads(b"\n".join([lines[0], lines[1], msgspec.json.encode(bad)]), str(path))
    bad = msgspec.json.decode(lines[1])
    bad["think_time_s"] = -1
    with pytest.raises(tr.TraceError, match=r":2: .*`\$\.think_time_s`"):
        tr.loads(b"\n".join([lines[0], msgspec.json.encode(bad)]))
    bad["think_time_s"], bad["index"] = 0.0, 4
    with pytest.raises(tr.TraceError, match=r":2: field `index` is 4, expected 0"):
        tr.loads(b"\n".join([lines[0], msgspec.json.encode(bad)]))
    bad["index"], bad["output_token_ids"] = 0, [len(tokenizer)]
    with pytest.raises(tr.TraceError, match=r":2: field `output_token_ids` holds an id >= vocab_size"):
        tr.loads(b"\n".join([lines[0], msgspec.json.encode(bad)]))
    with pytest.raises(tr.TraceError, match=r":1: not JSON"):
        tr.loads(b"{nope\n" + lines[1])
    with pytest.raises(tr.TraceError, match=r"no turns"):
        tr.loads(lines[0])


def test_generator_is_deterministic_and_within_its_shape(tokenizer):
    a, b = synth_trace(tokenizer, 11, SMALL), synth_trace(tokenizer, 11, SMALL)
    assert tr.dumps(a) == tr.dumps(b)
    assert tr.dumps(synth_trace(tokenizer, 12, SMALL)) != tr.dumps(a)

    for seed in range(4):
        t = synth_trace(tokenizer, seed, SMALL)
        assert SMALL.num_turns[0] <= t.num_turns <= SMALL.num_turns[1]
        assert abs(_count(tokenizer, t.header.system_prompt) - SMALL.system_tokens) <= 2
        assert t.turns[0].messages[0].role == "user"
        for turn in t.turns:
            assert turn.output_token_ids == tokenizer.encode(turn.output_text, add_special_tokens=False)
            assert SMALL.output_tokens[0] - 2 <= len(turn.output_token_ids) <= SMALL.output_tokens[1] + 2
            assert turn.think_time_s == 0.0 or SMALL.think_time_s[0] <= turn.think_time_s <= SMALL.think_time_s[1]
        for turn in t.turns[1:]:
            (m,) = turn.messages
            assert m.role == "tool" and m.tool_call_id == f"call_{turn.index - 1}"
            assert f'"name": "{m.name}"' in t.turns[turn.index - 1].output_text  # answers the previous call
            assert SMALL.tool_tokens[0] - 2 <= _count(tokenizer, m.content) <= SMALL.tool_tokens[1]


def test_default_shape_is_the_coding_agent_shape(tokenizer):
    t = synth_trace(tokenizer, 0)
    assert 30 <= t.num_turns <= 50
    assert abs(_count(tokenizer, t.header.system_prompt) - 2000) <= 2
    tool = [_count(tokenizer, turn.messages[0].content) for turn in t.turns[1:]]
    assert 198 <= min(tool) and max(tool) <= 4000 and max(tool) > 1000


def test_shape_validation():
    with pytest.raises(SynthShapeError, match="tool_tokens"):
        SynthShape(tool_tokens=(400, 200))


def test_forced_tokens_on_the_wire_are_validated():
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer

    with LocalServer(create_app(ServerConfig(db_url="sqlite+aiosqlite:///:memory:",
                                             engine_options={"device": "cpu", "num_pages": 256}))) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            chain = http.post("/v1/chains", json={}).raise_for_status().json()
            url = f"/v1/chains/{chain['id']}/turns"
            for sampling, key in (({"forced_token_ids": [1, 2, 3], "max_tokens": 2}, "sampling.forced_token_ids"),
                                  ({"forced_token_ids": [10**6]}, "sampling.forced_token_ids"),
                                  ({"forced_token_ids": [-1]}, "sampling.forced_token_ids[0]")):
                r = http.post(url, json={"messages": [{"role": "user", "content": "hi"}], "sampling": sampling})
                assert r.status_code == 400 and r.json()["extra"][0]["key"] == key, r.text
            body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "forced_token_ids": [5, 6]}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "forced_token_ids", r.text


def test_chain_cache_prefills_5x_fewer_tokens_than_dense_without_prefix_cache(tokenizer, tmp_path):
    """Two concurrent sessions replayed twice with forced outputs: a stateless client on a server without
    a prefix cache computes every prompt token of every turn; with Chain Cache (prefix cache off too) a turn
    computes only what it appended plus the previous turn's last generated token (whose KV no step wrote)."""
    from agentrt.replay.bench import serve_and_replay
    from agentrt.replay.replayer import TIER_MOVES, ReplayConfig
    from agentrt.replay.report import summarize, table, with_speedups
    from agentrt.replay.plots import write_plots

    shape = SynthShape(num_turns=(7, 7), system_tokens=150, task_tokens=(10, 20), tool_tokens=(60, 120),
                       output_tokens=(56, 64), think_time_s=(0.0, 0.02))
    traces = [synth_trace(tokenizer, seed, shape) for seed in (0, 1)]
    traces = [msgspec.structs.replace(t, header=msgspec.structs.replace(t.header, tools=[])) for t in traces]
    options = {"device": "cpu", "num_pages": 512}
    dense = serve_and_replay(traces, ReplayConfig("dense-noprefix", "stateless", prefix_cache=False),
                             engine_options=options)
    chain = serve_and_replay(traces, ReplayConfig("chain-noprefix", "chain", prefix_cache=False),
                             engine_options=options)

    key = lambda r: (r.session, r.turn)  # noqa: E731
    d, c = sorted(dense.turns, key=key), sorted(chain.turns, key=key)
    assert [key(r) for r in d] == [key(r) for r in c] == [(s, i) for s in (0, 1) for i in range(7)]
    for rd, rc in zip(d, c):
        recorded = traces[rd.session].turns[rd.turn]
        assert rd.text == rc.text == recorded.output_text  # both runs emitted the forced tokens
        assert rd.completion_tokens == rc.completion_tokens == len(recorded.output_token_ids)
        assert rd.prompt_tokens == rc.prompt_tokens  # the chain's log is the template's rendering
    generated = sum(len(t.output_token_ids) for trace in traces for t in trace.turns)
    assert dense.counters["agentrt_tokens_generated_total"] == chain.counters["agentrt_tokens_generated_total"] \
        == generated

    dense_prefilled = dense.counters["agentrt_tokens_prefilled_total"]
    assert dense_prefilled == sum(r.prompt_tokens for r in d)
    assert dense.counters["agentrt_tokens_prefix_cached_total"] == 0
    expected_chain = sum(r.prompt_tokens if r.turn == 0 else r.prompt_tokens - prev.prompt_tokens
                         - prev.completion_tokens + 1 for prev, r in zip([None] + c[:-1], c))
    chain_prefilled = chain.counters["agentrt_tokens_prefilled_total"]
    assert chain_prefilled == expected_chain == sum(r.prefilled_tokens for r in c)
    assert dense_prefilled >= 5 * chain_prefilled, (dense_prefilled, chain_prefilled)

    summaries = with_speedups([summarize(dense), summarize(chain)])
    assert summaries[1]["prefill_reduction"] == round(dense_prefilled / chain_prefilled, 3)
    for run, summary in zip((dense, chain), summaries):  # the wait: each session's turn latencies, averaged
        per_session = [sum(r.end - r.start for r in run.turns if r.session == s) for s in (0, 1)]
        assert summary["wait_s"] == pytest.approx(sum(per_session) / 2, abs=1e-4)
        assert summary["wait_s"] < run.wall_s and summary["turn_p50_s"] >= summary["ttft_p50_s"]
    assert summaries[1]["wait_speedup"] == round(summaries[0]["wait_s"] / summaries[1]["wait_s"], 3)
    assert len(summaries[0]["prefilled_per_turn"]) == 7 and summaries[0]["peak_kv_pages"] > 0
    assert "chain-noprefix" in table(summaries)
    for run, summary in zip((dense, chain), summaries):  # the engine's steps by kind (CPU: no graphs)
        steps, seconds = summary["engine_steps"], summary["engine_step_seconds"]
        assert steps["decode-graph"] == 0 and seconds["decode-graph"] == 0
        assert steps["prefill"] + steps["mixed"] >= 7  # every turn's prompt; two sessions may share a step
        # every token but a turn's first comes from a decode row; at most two sessions decode per step
        assert steps["decode-eager"] + steps["mixed"] >= (generated - 14) / 2
        assert 0 < sum(seconds.values()) <= run.wall_s
        assert summary["tier_seconds"] == dict.fromkeys(TIER_MOVES, 0.0)  # no tiers in these configurations
    pngs = write_plots(summaries, tmp_path)
    assert [p.read_bytes()[:8] for p in pngs] == [b"\x89PNG\r\n\x1a\n"] * 2


def _renderer(model_dir):
    from agentrt.chat import ChatRenderer
    from engine.llm_engine import load_tokenizer

    return ChatRenderer(load_tokenizer(model_dir), [])


def test_fit_trace_scales_the_long_parts_until_the_conversation_fits():
    from agentrt.replay.replayer import context_tokens
    from agentrt.replay.synth import fit_trace
    from engine.tiny_checkpoint import embedded_model_dir

    renderer = _renderer(embedded_model_dir())
    tok = renderer.tokenizer
    count = lambda t: context_tokens(renderer, t)  # noqa: E731
    shape = SynthShape(num_turns=(8, 8))  # the coding-agent shape: about 3x the embedded model's 4096
    whole = synth_trace(tok, 0, shape)
    assert count(whole) > 4096
    fitted = fit_trace(tok, 0, shape, 4096, count)
    assert count(fitted) <= 4096 and fitted.num_turns == 8
    assert 0 < fitted.header.metadata["scale"] < 1
    assert tr.dumps(fitted) == tr.dumps(fit_trace(tok, 0, shape, 4096, count))  # deterministic
    assert tr.dumps(fit_trace(tok, 0, shape, 10**6, count)) == tr.dumps(whole)  # fits: untouched
    with pytest.raises(SynthShapeError) as info:  # the outputs and tool definitions alone do not fit
        fit_trace(tok, 0, SynthShape(num_turns=(60, 60)), 4096, count)
    assert info.value.field == "num_turns"


def test_replay_cli_refuses_traces_that_cannot_fit_in_one_line(tmp_path, capsys):
    from agentrt.replay.cli import main
    from engine.tiny_checkpoint import embedded_model_dir

    # explicit token sizes are kept as given: a trace they make too long is the flags' fault
    assert main(["run", "--sessions", "1", "--turns", "8,8", "--system-tokens", "3000", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("agentrt replay run: --system-tokens: trace synth-0")
    assert "max_model_len" in err
    # a recorded trace longer than the model's context
    tok = _renderer(embedded_model_dir()).tokenizer
    tr.write(synth_trace(tok, 0, SynthShape(num_turns=(8, 8))), tmp_path / "long.jsonl")
    assert main(["run", "--traces", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"agentrt replay run: --traces {tmp_path}: trace synth-0")
    # a context set below the model's own
    assert main(["run", "--sessions", "1", "--turns", "2,2", "--engine-options", '{"max_model_len": 512}',
                 "--device", "cpu"]) == 2
    assert "--turns 2,2: trace synth-0" in capsys.readouterr().err


def test_replay_run_fits_generated_traces_to_the_embedded_model(tmp_path, capsys):
    """The README's `agentrt replay run` at a smaller size: the default shape does not fit the embedded model's
    4096 tokens, so its long parts are scaled down and every turn is served (no 422)."""
    import json

    from agentrt.replay.cli import main

    assert main(["run", "--sessions", "1", "--turns", "3,3", "--configs", "dense-chain", "--think-scale", "0",
                 "--device", "cpu", "--num-pages", "512", "--repeats", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "replay.json").read_text())
    assert report["model"] == "embedded tiny" and report["turns_per_session"] == [3]
    assert 0 < report["trace_scale"][0] < 1
    (result,) = report["results"]
    assert result["config"] == "dense-chain" and len(result["prefilled_per_turn"]) == 3
    assert "scaled by" in capsys.readouterr().err
    # --repeats: each run's summary in partial.jsonl, the report their median
    walls = [json.loads(line)["wall_s"] for line in (tmp_path / "partial.jsonl").read_text().splitlines()]
    assert len(walls) == 2 and result["runs"] == 2
    assert result["wall_s"] == pytest.approx(sum(walls) / 2) and result["spread"]["wall_s"] == sorted(walls)


def test_replay_report_joins_runs_and_computes_speedups_against_the_baseline(tmp_path, capsys):
    """`agentrt replay report`: summaries from several runs (one configuration a run), one table with speedups
    against --baseline; a file that is no summary, or a baseline no run has, is one line naming it."""
    import json

    from agentrt.replay.cli import main
    from agentrt.replay.report import STEP_KINDS

    def summary(name, wall, wait, prefilled):
        return {"config": name, "wall_s": wall, "wait_s": wait, "prefilled_tokens": prefilled, "ttft_p50_s": 0.1,
                "ttft_p90_s": 0.2, "prefix_cached_tokens": 0, "resumed_tokens": 0, "generated_tokens": 10,
                "peak_kv_pages": 5, "engine_steps": dict.fromkeys(STEP_KINDS, 1),
                "engine_step_seconds": dict.fromkeys(STEP_KINDS, 0.5)}

    tiers = {"offload": 1.5, "load_host": 0.25, "load_disk": 0.0, "load_wait": 3.75}
    (tmp_path / "a.jsonl").write_text(json.dumps(summary("dense-prefix", 60.0, 40.0, 1000)) + "\n")
    (tmp_path / "b.json").write_text(json.dumps({"results": [{**summary("snapkv-chain-tiers", 40.0, 16.0, 200),
                                                               "tier_seconds": tiers}]}))
    assert main(["report", str(tmp_path / "a.jsonl"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n}\n") + 2])["results"]
    snap = next(r for r in results if r["config"] == "snapkv-chain-tiers")
    assert (snap["speedup"], snap["wait_speedup"], snap["prefill_reduction"]) == (1.5, 2.5, 5.0)
    assert "snapkv-chain-tiers" in out and "2.50x" in out
    steps = out[out.index("load_wait s"):]  # the steps table: tier seconds where the summary has them, else "-"
    assert "3.75" in steps and "1.50" in steps and " -" in steps

    # a configuration run three times (e.g. in three calls): the median of each figure, the per-kind steps of the
    # median run, whole counts, [min-max] in the table; speedups from the medians
    runs = [{**summary("snapkv-chain-tiers", wall, wait, prefilled), "engine_steps": dict.fromkeys(STEP_KINDS, n)}
            for wall, wait, prefilled, n in ((44.0, 20.0, 210, 7), (30.0, 10.0, 190, 3), (40.0, 24.0, 201, 5))]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert main(["report", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")]) == 0
    out = capsys.readouterr().out
    snap = next(r for r in json.loads(out[: out.index("\n}\n") + 2])["results"] if r["config"] != "dense-prefix")
    assert (snap["runs"], snap["wall_s"], snap["wait_s"], snap["prefilled_tokens"]) == (3, 40.0, 20.0, 201)
    assert isinstance(snap["prefilled_tokens"], int) and snap["engine_steps"] == dict.fromkeys(STEP_KINDS, 5)
    assert snap["spread"]["wall_s"] == [30.0, 44.0] and (snap["speedup"], snap["wait_speedup"]) == (1.5, 2.0)
    assert "40.00 [30.00-44.00]" in out and "speedup_by_round" not in snap  # the baseline ran once

    # both configurations over the same three rounds: each round's ratio beside the ratio of the medians
    base = [summary("dense-prefix", wall, wait, 1000) for wall, wait in ((66.0, 40.0), (60.0, 30.0), (50.0, 48.0))]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in base))
    assert main(["report", str(tmp_path / "e.jsonl"), str(tmp_path / "c.jsonl")]) == 0
    out = capsys.readouterr().out
    snap = next(r for r in json.loads(out[: out.index("\n}\n") + 2])["results"] if r["config"] != "dense-prefix")
    assert snap["speedup"] == 1.5 and snap["speedup_by_round"] == [1.5, 2.0, 1.25]
    assert snap["wait_speedup_by_round"] == [2.0, 3.0, 2.0] and snap["spread"]["speedup"] == [1.25, 2.0]
    assert "1.50x [1.25x-2.00x]" in out
    (tmp_path / "d.json").write_text(json.dumps({"results": [{**runs[0], "runs": 3}]}))
    assert main(["report", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl"), str(tmp_path / "d.json")]) == 2
    assert "cannot be joined" in capsys.readouterr().err

    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["report", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl: not a replay.json or partial.jsonl" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "b.json")]) == 2
    assert "--baseline: no run of 'dense-prefix'" in capsys.readouterr().err


def test_each_configuration_is_warmed_up_on_its_own_paths_outside_the_timed_run(tokenizer, monkeypatch):
    """Before the timed run a configuration replays the first trace alone (every turn but its last) under a
    system prompt no timed session shares: its chain turns and its method's vote compile there, and nothing it
    leaves in the prefix cache serves a timed turn; the timed run replays the traces as they are."""
    from agentrt.replay import bench
    from agentrt.replay.replayer import Replayer

    shape = SynthShape(num_turns=(3, 3), system_tokens=120, task_tokens=(8, 8), tool_tokens=(20, 40))
    traces = [synth_trace(tokenizer, seed=i, shape=shape) for i in range(2)]
    runs = []
    original = Replayer.run

    async def run(self, replayed, config):
        runs.append(([t.header.system_prompt for t in replayed], [t.num_turns for t in replayed], self.think_scale))
        return await original(self, replayed, config)

    monkeypatch.setattr(Replayer, "run", run)
    config = bench.standard_configs({"budget": 32, "window": 8})["snapkv-chain"]
    result = bench.serve_and_replay(traces, config, engine_options={"device": "cpu", "num_pages": 256},
                                    think_scale=1.0)
    (warm_prompts, warm_turns, warm_think), timed = runs
    assert warm_prompts == [bench.WARM_UP_MARK + traces[0].header.system_prompt] and warm_turns == [2]
    assert warm_think == 0.0 and timed == ([t.header.system_prompt for t in traces], [3, 3], 1.0)
    assert len(result.turns) == 6  # the timed run's turns only
    assert bench.warm_up_trace(tr.Trace(header=traces[0].header, turns=traces[0].turns[:1])) is None


def test_a_failed_session_stops_the_others_and_its_error_is_the_runs(monkeypatch):
    """A session whose turn the server refuses ends the run with that error; the other sessions are cancelled
    then, not left running against closed clients (each would fail again, unreported)."""
    import asyncio

    from agentrt.replay import bench
    from agentrt.replay.replayer import Replayer
    from sdk.errors import AgentrtError

    ended = []

    async def chain(self, client, session, trace, t0, config):
        try:
            await asyncio.sleep(0.05 if session == 0 else 30)
            if session == 0:
                raise AgentrtError("request needs more KV pages than the pool has", status_code=422)
            return []
        finally:
            ended.append((session, asyncio.current_task().cancelling() > 0))

    async def metrics(self, http):
        return {}

    monkeypatch.setattr(Replayer, "_chain", chain)
    monkeypatch.setattr(Replayer, "_metrics", metrics)
    config = bench.standard_configs({})["snapkv-chain"]

    async def run():
        try:
            await asyncio.wait_for(Replayer("http://127.0.0.1:9", "m").run([None, None, None], config), 10)
        finally:
            ended.append(("run", False))

    with pytest.raises(AgentrtError, match="KV pages"):
        asyncio.run(run())
    assert ended[0] == (0, False) and sorted(ended[1:3]) == [(1, True), (2, True)] and ended[3] == ("run", False)
