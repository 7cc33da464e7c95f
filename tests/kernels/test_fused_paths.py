"""The side-by-side benchmark of the fused paths runs and each fused path equals the torch code it replaces
(compiled on a GPU, Triton's interpreter on a CPU, at tiny sizes)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks.fused_paths import main  # noqa: E402


def test_every_fused_path_equals_its_torch_path():
    rows = main(["--tiny"])
    assert [r["case"] for r in rows] == ["kivi-encode", "snapkv-vote", "probe-attention", "rotary-store"]
    assert all(r["equal"] for r in rows), rows
