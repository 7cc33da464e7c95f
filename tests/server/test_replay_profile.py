"""``benchmarks.replay_profile``: a window of a replay's engine steps under torch.profiler, reported by step kind.
On the CPU there is no device activity (every profiled step is idle time); the window and the kinds are exact."""

import json

from benchmarks.replay_profile import main


def test_a_window_of_replay_steps_is_profiled_by_kind(tmp_path):
    out = main(["--first-step", "2", "--steps", "9", "--json", str(tmp_path / "p.json"), "--",
                "--sessions", "2", "--turns", "3,3", "--configs", "snapkv-chain", "--think-scale", "0",
                "--device", "cpu", "--num-pages", "512", "--out", str(tmp_path / "replay")])
    assert out["replay_rc"] == 0 and (tmp_path / "p.json").exists() and (tmp_path / "replay" / "replay.json").exists()
    assert out["profiled_steps"] == 9 and out["steps_seen"] > 11
    # steps are counted from the timed run's start (the configuration's warm-up before it is not profiled): every
    # step counted is one of the run's forward steps by kind
    (result,) = json.loads((tmp_path / "replay" / "replay.json").read_text())["results"]
    assert out["steps_seen"] == sum(result["engine_steps"].values())
    kinds = out["kinds"]
    assert sum(k["steps"] for k in kinds.values()) == 9
    assert set(kinds) <= {"decode-graph", "decode-eager", "mixed", "prefill", "window-launch"}
    assert "decode-eager" in kinds and ({"mixed", "prefill"} & set(kinds))  # the first turns' prompts
    for k in kinds.values():
        assert k["median_busy_ms"] == 0 and k["median_wall_ms"] > 0 and k["device_ms_per_step"] == {}
        assert k["median_execute_ms"] <= k["median_wall_ms"]
    assert out["host_self_ms"]


def test_a_window_past_the_run_says_so(tmp_path):
    out = main(["--first-step", "0", "--steps", "100000", "--", "--sessions", "1", "--turns", "2,2", "--configs",
                "dense-chain", "--think-scale", "0", "--device", "cpu", "--num-pages", "256",
                "--out", str(tmp_path / "replay")])
    assert out["replay_rc"] == 0 and out["profiled_steps"] == 0 and "must end inside the run" in out["error"]
