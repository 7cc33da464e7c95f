"""benchmarks.throughput's counts: every decode step after the batch's first tokens is timed and counted, and on a CPU
none replays a graph (exact counters, with and without back-to-back decode windows); the roofline's FLOP and
byte ceilings; both HF baselines. The counting rules themselves: tests/engine/test_bench_counting.py."""

import pytest

from benchmarks.throughput import main


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_timed_steps_and_graph_replays_are_counted(decode_steps):
    (r,) = main(["--shape", "tiny", "--cases", "2@64", "--decode-tokens", "9", "--device", "cpu",
                 "--decode-steps", str(decode_steps)])
    assert r["timed_decode_steps"] == 8 and r["graph_replayed_steps"] == 0 and r["cuda_graphs"] is False
    assert r["decode_steps"] == decode_steps
    # one step() call a window of decode steps; the slowest three listed longest first, each counting its steps
    assert r["window_step_calls"] == 8 // decode_steps
    slowest = r["slowest_steps"]
    assert len(slowest) == min(3, r["window_step_calls"])
    assert [s["ms"] for s in slowest] == sorted((s["ms"] for s in slowest), reverse=True)
    assert all(s["decode_steps"] == decode_steps and 0 <= s["index"] < r["window_step_calls"] for s in slowest)


def test_spec_bandwidth_by_gpu_name():
    from benchmarks.roofline import spec_bandwidth

    assert spec_bandwidth("NVIDIA H200") == 4.8e12
    assert spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert spec_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12 and spec_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert spec_bandwidth(None) is None and spec_bandwidth("cpu") is None
    assert spec_bandwidth("NVIDIA GH200 480GB") is None  # its HBM differs by variant: not guessed


def test_roofline_counts_the_lm_head_once_per_prompt_and_reports_both_ceilings(tmp_path):
    """Prefill FLOPs: every weight but the LM head once per prompt token, the LM head once per prompt (logits of
    the last token only). Decode: fractions of the copy rate and of the spec bandwidth, the same bytes."""
    from engine import EngineConfig, LLMEngine
    from benchmarks.throughput import add_roofline, write_shape_dir

    engine = LLMEngine(EngineConfig(write_shape_dir("tiny", tmp_path), load_format="dummy", dtype="float32",
                                    device="cpu", num_pages=64))
    mc = engine.model_config
    r = {"batch": 2, "context": 100, "decode_tokens": 10, "decode_tok_s": 50.0, "prefill_tok_s": 1000.0,
         "full_batch_step_ms": 20.0}
    add_roofline(r, engine, copy_bw=1e12, matmul=1e14, spec_bw=2e12)
    head = mc.vocab_size * mc.hidden_size
    others = sum(p.numel() for n, p in engine.model.named_parameters()
                 if "embed_tokens" not in n and "lm_head" not in n)
    attn = 4 * mc.num_layers * mc.num_heads * mc.head_dim * 100**2 / 2
    flops = 2 * (2 * others * 100 + 2 * head + attn)
    assert r["prefill_tflop_s"] * 1e12 == pytest.approx(flops / (2 * 100 / 1000.0))
    assert r["spec_roofline_fraction"] == pytest.approx(r["roofline_fraction"] / 2)
    assert r["full_batch_spec_roofline_fraction"] == pytest.approx(r["full_batch_roofline_fraction"] / 2)
    add_roofline(r, engine, copy_bw=1e12, matmul=1e14, spec_bw=None)
    assert r["spec_roofline_fraction"] is None and r["spec_tb_s"] is None


def test_hf_baselines_eager_and_static_compiled_in_the_same_run():
    """Both HF baselines on the CPU (the compiled one through torch.compile's eager backend, to stay quick):
    their warm-up (the compile) is reported apart, and each speedup is against its own baseline."""
    (r,) = main(["--shape", "tiny", "--cases", "2@32", "--decode-tokens", "5", "--device", "cpu", "--dtype",
                 "float32", "--repeats", "1", "--hf", "--hf-compiled", "on", "--hf-compile-backend", "eager"])
    assert r["hf_decode_tok_s"] > 0 and r["hf_compiled_decode_tok_s"] > 0 and r["hf_compiled_warmup_s"] > 0
    assert r["speedup_vs_hf"] == r["decode_tok_s"] / r["hf_decode_tok_s"]
    assert r["speedup_vs_hf_compiled"] == r["decode_tok_s"] / r["hf_compiled_decode_tok_s"]
    assert set(r["spread"]) >= {"decode_tok_s", "hf_decode_tok_s", "hf_compiled_decode_tok_s"}
