"""An MLA model's engine on the GPU against the same engine on the CPU: the decode step's GPU-only paths (the
latent-inputs kernel, the router with its gate product, the shared expert in the grouped expert kernel, decode
CUDA graphs, the MLA decode kernel) must give the CPU engine's greedy tokens (its torch references).

GPU only: on a CPU both runs would take the same torch code."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("compares the GPU engine with the CPU one", allow_module_level=True)
# fp32 dots in full precision (Triton's default for fp32 is TF32): the runs compare fp32 engines
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_an_mla_engine_on_the_gpu_gives_the_cpu_engines_tokens(arch, mla_dirs):
    """fp32, prompts of different lengths prefilled in chunks beside decoding requests, then decoded (graph
    replays on the GPU); greedy tokens equal and logprobs within 2e-3 of the CPU engine's."""
    from tests.device_parity import assert_gpu_engine_matches_cpu

    assert_gpu_engine_matches_cpu(mla_dirs[arch], num_pages=128, seed=5)
