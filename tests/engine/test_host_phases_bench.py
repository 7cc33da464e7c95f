"""The host-phase benchmark runs on a CPU and reports the engine's own step phases per method."""

from benchmarks.host_phases import PHASES, main


def test_host_phase_rows():
    rows = main(["--batch", "4", "--layers", "3", "--prompt", "40", "--steps", "3",
                 "--methods", 'dense;kvzip:{"budget":16}'])
    assert [r["method"] for r in rows] == ["dense", "kvzip"]
    for r in rows:
        ph = r["step_phase_ms"]
        assert set(ph) == set(PHASES) and all(v >= 0 for v in ph.values()) and ph["execute"] > 0
        assert abs(r["host_ms"] - (ph["schedule"] + ph["prepare"] + ph["update"])) < 1e-9
