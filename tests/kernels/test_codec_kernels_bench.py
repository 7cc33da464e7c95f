"""The coded-KV kernel sweep runs end to end (the interpreter on a CPU, tiny shapes): each storage's kernel
matches the torch reference over the same pages, every configuration matches the default's output, and the
byte counts are the codec's."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks.codec_kernels import main  # noqa: E402


def test_codec_kernel_sweep_rows():
    rows = main(["--tiny", "--storages", "fp8,kivi4"])
    assert [r["storage"] for r in rows] == ["fp8", "kivi4"]
    for r in rows:
        assert r["rel_err_vs_ref"] < 1e-5, r
        assert [c["num_splits"] for c in r["configs"]] == [r["default_splits"], 2 * r["default_splits"]]
        assert all(c["rel_diff"] < 1e-5 for c in r["configs"]), r["configs"]
    # fp8 on fp32 KV (tiny): one code byte per element + one fp32 scale per (token, head) and side
    fp8 = rows[0]
    assert fp8["bytes_ratio"] == pytest.approx((64 + 4) / (64 * 4))
