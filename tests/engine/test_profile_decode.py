"""The decode profiler's arithmetic (device busy time as a union of intervals, gaps attributed to engine
phases) and a whole-step run on the CPU (no device activity: all idle)."""

from benchmarks.profile_decode import _phase_at, _union, main


def test_union_and_phase_attribution():
    assert _union([(5, 6), (0, 2), (1, 3), (2.5, 2.8)]) == 4
    assert _union([]) == 0
    phases = {"schedule": 0.1, "prepare": 0.2, "execute": 1.0, "update": 0.05}  # ms
    assert [_phase_at(us, phases) for us in (50, 150, 400, 1320, 1400)] == [
        "schedule", "prepare", "execute", "update", "after"]


def test_whole_steps_on_the_cpu(tmp_path):
    out = main(["--shape", "tiny", "--batch", "2", "--context", "64", "--steps", "2", "--device", "cpu",
                "--dtype", "float32", "--json", str(tmp_path / "p.json")])
    assert len(out["steps"]) == 2 and (tmp_path / "p.json").exists()
    assert out["device_ms_per_step"] == {}  # no device kernels on the CPU
    for step in out["steps"]:
        assert step["busy_us"] == 0 and step["wall_ms"] > 0 and step["gaps"][0]["idle_us"] > 0
