"""The synthetic-KV sparse benchmark runs each method's real code: SnapKV compacts the synthetic context,
so more requests fit than dense; Quest's page bounds are rebuilt for KV written outside a step."""

import torch

import policies.quest  # noqa: F401
from benchmarks.sparse_decode import main
from agentrt_kernels.torch_ref.quest import page_key_bounds


def test_synthetic_kv_bench_admits_more_requests_under_snapkv():
    results = main(["--shape", "tiny", "--context", "512", "--window", "16", "--max-batch", "6",
                    "--decode-steps", "4", "--kv-bytes", "4000000", "--dtype", "float32", "--device", "cpu",
                    "--methods", 'dense;snapkv:{"budget":64,"window":8}', "--repeats", "1"])
    dense, snap = results
    assert dense["batch"] == 1 and snap["batch"] >= 5  # 6 fit the pool; one's pages are kept as headroom
    for r in results:  # the headroom kept for growth: every timed step decodes every admitted request
        assert round(r["decode_tok_s"] * r["step_ms"] / 1e3) == r["batch"]
        phases = r["step_phase_ms"]  # the engine's own step timing (medians), in ms like the measured step
        assert set(phases) == {"schedule", "prepare", "execute", "update"} and phases["execute"] > 0
        assert sum(phases.values()) < 1.5 * r["step_ms"]
    assert snap["pages_per_request"] < dense["pages_per_request"] / 4


def test_quest_rebuilds_page_bounds_for_kv_loaded_outside_a_step(tiny_dirs):
    from engine import LLM, SamplingParams

    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, method="quest",
              method_config={"token_budget": 8, "dense_layers": 0})
    engine = llm.engine
    rid = engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=2))
    req = engine._requests[rid]
    assert engine.cache.allocate(req, 26)
    k_cache, _ = engine.cache.layer_kv(1)
    k_cache.normal_()
    engine.cache.commit(req, 26)
    engine.method.kv_loaded(req, engine.cache)
    pages = torch.tensor(engine.cache.table(req).pages)
    valid = torch.tensor([4] * 6 + [2])
    lo, hi = page_key_bounds(k_cache, pages, valid)
    torch.testing.assert_close(engine.method._kmin[1][pages], lo)
    torch.testing.assert_close(engine.method._kmax[1][pages], hi)
    engine.abort(rid)


def test_h2o_scores_slots_loaded_outside_a_step_as_unattended():
    results = main(["--shape", "tiny", "--context", "256", "--window", "16", "--max-batch", "2",
                    "--decode-steps", "3", "--kv-bytes", "4000000", "--dtype", "float32", "--device", "cpu",
                    "--methods", 'h2o:{"heavy_budget":16,"recent_budget":16}'])
    (h2o,) = results
    assert h2o["batch"] == 2
    assert h2o["pages_per_request"] <= -(-(32 + 3 + 1) // 16) + 1  # compacted to the budget despite the fill


def test_the_latent_and_hybrid_shapes_run_the_same_benchmark():
    """Latent rows (one per token and layer) and a hybrid (KV in its full-attention layers only): SnapKV compacts
    the synthetic context here too, and the KV bytes per token are the storage's."""
    for shape, kv_bytes_per_token in (("tiny-mla", 4 * (64 + 16) * 4), ("tiny-hybrid", 2 * 2 * 2 * 64 * 4)):
        dense, snap = main(["--shape", shape, "--context", "256", "--max-batch", "2", "--decode-steps", "2",
                            "--dtype", "float32", "--device", "cpu", "--repeats", "1",
                            "--methods", 'dense;snapkv:{"budget":32,"window":8}'])
        assert snap["pages_per_request"] < dense["pages_per_request"] / 2
        assert dense["kv_bytes_per_token"] == kv_bytes_per_token, shape


def test_a_pool_that_holds_no_request_is_an_error_not_a_wait():
    """Nothing admitted (a context longer than the pool holds): the run says so instead of timing steps in which
    no request ever decodes."""
    import pytest

    with pytest.raises(RuntimeError, match="no request of 512 tokens fits the KV pool"):
        main(["--shape", "tiny", "--context", "512", "--max-batch", "2", "--decode-steps", "2", "--kv-bytes",
              "200000", "--dtype", "float32", "--device", "cpu", "--methods", "dense", "--repeats", "1"])
