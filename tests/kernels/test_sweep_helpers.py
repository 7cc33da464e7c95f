"""The launch sweeps' shared bookkeeping (benchmarks.sweep_helpers): which launch is recorded how, and which wins."""

from benchmarks.sweep_helpers import cycling, fastest, sweep_launches


def test_a_launch_that_fails_is_recorded_and_the_fastest_of_the_rest_wins():
    times = {1: 3.0, 2: 1.0, 4: 2.0}

    def check(launch):
        if launch["block"] == 8:
            raise RuntimeError("out of shared memory")
        return {"ok": True}

    launches = sweep_launches([{"block": b} for b in (1, 2, 4, 8)], check, lambda launch: times[launch["block"]])
    assert launches[3]["error"].startswith("RuntimeError: out of shared memory") and "s" not in launches[3]
    assert [c["s"] for c in launches[:3]] == [3.0, 1.0, 2.0] and all(c["ok"] for c in launches[:3])
    assert fastest(launches, {"block": 4}, ["block", "warps"]) == {
        "default_s": 2.0, "best_s": 1.0, "best_launch": {"block": 2, "warps": None}}
    assert fastest(launches, {"block": 8}, ["block"])["default_s"] is None  # the default did not compile


def test_cycling_takes_each_operand_in_turn():
    seen = []
    call = cycling(seen.append, ["a", "b", "c"])
    for _ in range(4):
        call()
    assert seen == ["a", "b", "c", "a"]
