"""The router's launch sweep runs end to end (the interpreter on a CPU, tiny shapes): every launch of the fused
norm + gate product routes each row to the experts the unfused path (norm kernel, fp32 GEMM, routing) chooses."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks.router_kernels import TINY_SPACE, main  # noqa: E402


def test_router_sweep_rows():
    (row,) = main(["--tiny", "--rows", "3"])
    assert [{k: c[k] for k in TINY_SPACE} for c in row["launches"]] == [
        {"norm_tile": t, "num_warps": 4} for t in TINY_SPACE["norm_tile"]]
    assert all(c["same_experts"] for c in row["launches"]), row["launches"]
    assert row["best_s"] == min(c["s"] for c in row["launches"]) and row["gate_bytes"] == 16 * 512 * 4
