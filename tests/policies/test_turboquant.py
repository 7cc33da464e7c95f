"""The TurboQuant KV codec against its definition: the normalised MSE is Max's 1960 Lloyd-Max distortion of a unit
Gaussian, within the paper's bound."""

import math

import pytest
import torch

from engine.registry import create_kv_storage
from tests.codec_reference import kv_samples, roundtrip


# --- reconstruction -------------------------------------------------------------------------------------------
MAX_1960 = {2: 0.1175, 3: 0.03454, 4: 0.009497}  # Lloyd-Max MSE of a unit Gaussian at b bits (Max, 1960)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turboquant_mse_is_the_lloyd_max_distortion(bits, tiny_dirs):
    codec = create_kv_storage("turboquant", {"bits": bits})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 2, 64, generator=g) * torch.rand(4096, 2, 1, generator=g) * 5
    err = (roundtrip(codec, "key", x) - x).pow(2).sum(-1) / x.pow(2).sum(-1)
    # every rotated coordinate of a unit vector in R^64 is close to N(0, 1/64): the normalised MSE is Max's
    # per-coordinate distortion (slightly below it: the Beta law has lighter tails), and within the paper's
    # bound sqrt(3) pi / 2 * 4^-b
    assert MAX_1960[bits] * 0.9 < err.mean() < MAX_1960[bits] * 1.02
    assert err.mean() < math.sqrt(3) * math.pi / 2 * 4.0**-bits
    for _, k, v in kv_samples(tiny_dirs):
        for x in (k, v):
            e = ((roundtrip(codec, "key", x) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean()
            assert e < 2 * MAX_1960[bits]  # few samples from one distribution: a loose bound
