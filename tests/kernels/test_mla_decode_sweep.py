"""benchmarks.mla_decode_sweep's smoke run (the interpreter on a CPU), over bf16 rows and over E4M3 codes: every
configuration of its tiny grid and split count computes the default launch's output; the best configuration is the
fastest one timed."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's; on a GPU the suite runs it")
@pytest.mark.parametrize("coded", [False, True], ids=["bf16", "e4m3"])
def test_the_tiny_sweep_agrees_with_the_default_launch(coded):
    from benchmarks import mla_decode_sweep

    (row,) = mla_decode_sweep.main(["--tiny"] + (["--coded"] if coded else []))
    assert row["coded"] == coded and ("bf16_default" in row) == coded
    timed = [c for c in row["configs"] if "ms" in c]
    assert len(timed) == 2 and all(c["max_rel_vs_default"] < 1e-2 for c in timed)
    assert row["best"]["ms"] == min(c["ms"] for c in timed)
    # both timed launches (the top ones, at most three) over both split counts, fastest first
    assert [(s["rank"], s["num_splits"]) for s in row["top_by_splits"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert row["top_by_splits"][0]["block_n"] == row["best"]["block_n"]
    assert all(s["max_rel_vs_default"] < 1e-2 for s in row["top_by_splits"])
    assert row["best_split"]["ms"] == min(s["ms"] for s in row["top_by_splits"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's")
def test_launch_only_runs_the_kernel_with_the_keywords_given(monkeypatch):
    """``--launch-only``: the kernel launched as often as asked with the keywords given (what a profiler attaches
    to), nothing timed."""
    from agentrt_kernels.triton import mla_decode
    from benchmarks import mla_decode_sweep

    calls = []
    inner = mla_decode.mla_paged_decode
    monkeypatch.setattr(mla_decode, "mla_paged_decode", lambda *a, **kw: calls.append(kw) or inner(*a, **kw))
    rows = mla_decode_sweep.main(["--tiny", "--launch-only", '{"num_splits": 2}', "--launches", "3"])
    assert [(r["batch"], r["context"], r["finite"]) for r in rows] == [(2, 40, True)]
    assert calls == [{"num_splits": 2}] * 3
