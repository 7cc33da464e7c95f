"""Choosing the attention backend on a machine without a GPU: auto takes the torch reference; a GPU backend
named explicitly, or an unknown name, is a ConfigError naming the option."""

import re

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.errors import ConfigError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")


def test_auto_is_torch_on_cpu(tiny_dirs):
    engine = LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cpu", attention_backend="auto"))
    assert engine.backend.name == "torch"


@pytest.mark.parametrize("name", ["triton", "flashinfer", "triton+flashinfer"])
def test_gpu_backends_need_a_gpu(tiny_dirs, name):
    with pytest.raises(ConfigError, match=re.escape(f"attention_backend '{name}' needs a CUDA device")):
        LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cpu", attention_backend=name))


def test_unknown_backend_names_the_choices(tiny_dirs):
    with pytest.raises(ConfigError, match=r"attention_backend must be one of .*'triton\+flashinfer'"):
        LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cpu", attention_backend="cudnn"))


def test_auto_prefers_flashinfers_prefill_on_a_gpu_when_installed():
    from engine.attention_backend import auto_candidates

    assert auto_candidates(torch.device("cpu"), True) == ["torch"]
    assert auto_candidates(torch.device("cuda"), True) == ["triton+flashinfer", "triton", "torch"]
    assert auto_candidates(torch.device("cuda"), False) == ["triton", "torch"]


def test_a_backend_registered_by_name_is_built_and_checked_like_the_others(tiny_dirs, monkeypatch):
    """``BACKENDS`` is the one list of backends: an entry added there (its class by ``module:QualName``) is what
    ``attention_backend`` names, built from the engine's device and checked against the method."""
    from engine import attention_backend as ab

    class Recording(ab.TorchReferenceBackend):
        name = "recording"
        built_on = None

        def __init__(self, device=None):
            Recording.built_on = device

    monkeypatch.setattr(ab, "Recording", Recording, raising=False)
    monkeypatch.setitem(ab.BACKENDS, "recording", ab.BackendEntry("engine.attention_backend:Recording", cuda=False))
    engine = LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cpu", dtype="float32", attention_backend="recording"))
    assert type(engine.backend) is Recording and Recording.built_on == torch.device("cpu")
    monkeypatch.setattr(Recording, "dtypes", (torch.bfloat16,))
    with pytest.raises(ConfigError, match="cannot run on attention_backend 'recording'.*does not run torch.float32"):
        LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cpu", dtype="float32", attention_backend="recording"))
