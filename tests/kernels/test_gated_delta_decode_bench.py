"""benchmarks.gated_delta_decode's smoke run (the interpreter on a CPU): the in-place kernels and the gathered path
they replace give the same outputs, recurrent states and conv states."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's; on a GPU the suite runs it")
def test_the_two_paths_agree():
    from benchmarks import gated_delta_decode

    (row,) = gated_delta_decode.main(["--tiny"])
    assert row["out_max_rel"] < 3e-2 and row["state_max_rel"] < 2e-2 and row["conv_state_equal"]  # bf16 inputs
    assert row["in_place_ms"] > 0 and row["gathered_ms"] > 0
