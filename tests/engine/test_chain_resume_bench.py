"""benchmarks.chain_resume on the CPU at tiny sizes: each mode's timed turn is what it says (resumed from the
device, loaded from host memory, loaded from its disk file, recomputed from its tokens), prefilling only the new
tokens except when recomputing, and every turn starts from the same chain (rewound between turns)."""

from benchmarks.chain_resume import main


def test_every_mode_resumes_as_named_and_only_recompute_prefills_the_history():
    results = main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "256",
                    "--new-tokens", "16", "--repeats", "2", "--tier-bytes", str(2**28), "--page-size", "16"])
    by_mode = {r["mode"]: r for r in results}
    assert list(by_mode) == ["resident", "host", "disk", "recompute"]
    for mode in ("resident", "host", "disk"):
        assert by_mode[mode]["prefilled"] == 16 and by_mode[mode]["resumed"] == 256 and by_mode[mode]["context"] == 256
    assert by_mode["recompute"]["prefilled"] == 256 + 16 and by_mode["recompute"]["resumed"] == 0
    assert by_mode["resident"]["load_ms"] == 0 and by_mode["host"]["load_ms"] > 0 and by_mode["disk"]["load_ms"] > 0
    assert by_mode["host"]["chain_bytes"] > 0
    for r in results:
        assert 0 < r["ttft_ms_min"] <= r["ttft_ms"] <= r["ttft_ms_max"] and r["repeats"] == 2
