"""benchmarks.serving on the CPU at tiny sizes: every method config serves every request to its full length
through the step API, with prefill and admission inside the timed span, and the driver's admission keeps the
pool from preempting (closed loop at the largest concurrency the pool sustains, and Poisson arrivals).
The TTFT / TPOT arithmetic itself is checked on a synthetic timeline in tests/engine/test_bench_counting.py."""

from benchmarks.serving import main

TINY = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "1"]


def test_every_default_method_config_serves_every_request():
    results = main([*TINY, "--input-len", "256", "--output-lens", "16", "--num-requests", "8"])
    assert [r["method"] for r in results] == ["dense", "snapkv", "quest", "omnikv", "snapkv+fp8"]
    for r in results:
        assert r["completed"] == 8 and r["preemptions"] == 0 and r["arrivals"] == "closed-loop"
        assert r["concurrency"] == 8  # the default pool holds all of them
        assert round(r["output_tok_s"] * r["duration_s"]) == 8 * 16  # every token every client received
        assert round(r["request_throughput"] * r["duration_s"]) == 8
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] <= r["e2e_ms_p99"] and r["tpot_ms_p50"] > 0
        kinds = r["step_kinds"]  # the prompts' prefill is part of the timed span
        assert kinds.get("prefill", {}).get("steps", 0) + kinds.get("mixed", {}).get("steps", 0) >= 1
        assert sum(k["s"] for k in kinds.values()) <= r["duration_s"]
        assert r["engine_warmup_tokens"] == 0  # no engine warm-up on a CPU (engine.warmup)
    assert results[-1]["kv_storage"] == "fp8" and results[1]["config"] == {"budget": 4096}


def test_a_small_pool_sets_the_concurrency_and_compaction_raises_it():
    dense, snap = main([*TINY, "--input-len", "256", "--output-lens", "16", "--num-requests", "8",
                        "--num-pages", "64", "--methods", 'dense;snapkv:{"budget":64,"window":8}'])
    assert dense["pages_per_request_at_end"] == 16 + 1 + 1 and dense["concurrency"] == 64 // 18
    assert dense["max_running"] <= 3 and dense["preemptions"] == 0 and dense["completed"] == 8
    assert snap["pages_after_prompt"] < dense["pages_after_prompt"] and snap["concurrency"] > dense["concurrency"]
    assert snap["preemptions"] == 0 and snap["completed"] == 8


def test_poisson_arrivals():
    (r,) = main([*TINY, "--input-len", "64", "--output-lens", "8", "--num-requests", "6", "--rate", "50",
                 "--methods", "dense"])
    assert r["arrivals"] == "poisson" and r["rate"] == 50 and r["concurrency"] is None
    assert r["completed"] == 6 and r["admission_wait_ms_p50"] >= 0
