"""engine.bench's counts: every decode step after the batch's first tokens is timed and counted, and on a CPU
none replays a graph (exact counters, with and without back-to-back decode windows)."""

import pytest

from engine.bench import main


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_timed_steps_and_graph_replays_are_counted(decode_steps):
    (r,) = main(["--shape", "tiny", "--cases", "2@64", "--decode-tokens", "9", "--device", "cpu",
                 "--decode-steps", str(decode_steps)])
    assert r["timed_decode_steps"] == 8 and r["graph_replayed_steps"] == 0 and r["cuda_graphs"] is False
    assert r["decode_steps"] == decode_steps
