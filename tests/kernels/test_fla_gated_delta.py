"""fla-core's gated delta rule kernels (the GPU path of ``agentrt_kernels.ops.gated_delta_prefill`` / ``_decode``)
against the torch reference, and a hybrid model's engine on the GPU against the same engine on the CPU.

GPU only: fla's kernels need a CUDA device even to autotune (the Triton interpreter cannot run them)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("fla-core's kernels need a CUDA device", allow_module_level=True)
pytest.importorskip("fla")
# fp32 dots in full precision (Triton's default for fp32 is TF32): the fp32 cases compare with fp32 references
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from agentrt_kernels import fla_gated_delta  # noqa: E402
from agentrt_kernels.ops import gated_delta_decode, gated_delta_prefill  # noqa: E402
from agentrt_kernels.torch_ref.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402

CUDA = torch.device("cuda")
# Qwen3-Next's ratio of value to key heads (2) at small sizes; Dk = Dv = 128 as in the released models
HK, HV, DK, DV = 2, 4, 128, 128


def inputs(num_tokens: int, batch: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, DK, generator=g)
    k = torch.randn(num_tokens, HK, DK, generator=g)
    v = torch.randn(num_tokens, HV, DV, generator=g)
    log_decay = -torch.rand(num_tokens, HV, generator=g) * 0.5  # g <= 0, as -exp(A_log) * softplus(.)
    beta = torch.rand(num_tokens, HV, generator=g)
    states = torch.randn(batch, HV, DK, DV, generator=g) * 0.1
    return (q.to(CUDA, dtype), k.to(CUDA, dtype), v.to(CUDA, dtype), log_decay.to(CUDA), beta.to(CUDA, dtype),
            states.to(CUDA))


def assert_close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert err <= rel * scale, f"max abs error {err} vs {rel} * {scale}"


def test_the_gpu_path_is_fla():
    x = torch.zeros(1, device=CUDA)
    assert fla_gated_delta.available(x) and not fla_gated_delta.available(x.cpu())


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_packed_prefill_segments_each_from_its_state_equal_the_reference(dtype, rel):
    lens = [3, 64, 130, 1, 257]  # under, at and across fla's 64-token chunks; a one-token segment
    q, k, v, g, beta, states = inputs(sum(lens), len(lens), dtype, seed=0)
    out, finals = gated_delta_prefill(q, k, v, g, beta, states, lens)
    assert out.shape == v.shape and out.dtype == dtype and finals.shape == states.shape
    assert finals.dtype == torch.float32
    start = 0
    for i, n in enumerate(lens):
        ref, ref_state = chunk_gated_delta_rule(q[start:start + n].float(), k[start:start + n].float(),
                                                v[start:start + n].float(), g[start:start + n],
                                                beta[start:start + n].float(), states[i])
        assert_close(out[start:start + n], ref, rel)
        assert_close(finals[i], ref_state, rel)
        start += n


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_one_decode_token_per_sequence_equals_the_reference(dtype, rel):
    batch = 7
    q, k, v, g, beta, states = inputs(batch, batch, dtype, seed=1)
    out, new = gated_delta_decode(q, k, v, g, beta, states)
    for i in range(batch):
        ref, ref_state = recurrent_gated_delta_rule(q[i:i + 1].float(), k[i:i + 1].float(), v[i:i + 1].float(),
                                                    g[i:i + 1], beta[i:i + 1].float(), states[i])
        assert_close(out[i], ref[0], rel)
        assert_close(new[i], ref_state, rel)


def test_a_hybrid_engine_on_the_gpu_gives_the_cpu_engines_tokens(tmp_path):
    """Qwen3-Next tiny checkpoint, fp32: prompts of different lengths prefilled together in chunks (several
    segments per fla launch), then decoded; greedy tokens and logprobs as the CPU engine's (torch reference)."""
    from engine.tiny_checkpoint import make_tiny_checkpoint
    from tests.device_parity import assert_gpu_engine_matches_cpu

    model = make_tiny_checkpoint(tmp_path / "qwen3_next", "qwen3_next", seed=13, hidden_size=128, num_heads=4,
                                 num_kv_heads=2, intermediate_size=192, vocab_size=512, head_dim=32,
                                 partial_rotary_factor=0.5, linear_key_head_dim=64, linear_value_head_dim=64,
                                 max_position_embeddings=1024, initializer_range=0.1)
    assert_gpu_engine_matches_cpu(model, num_pages=64, seed=3)


def test_a_chains_turn_end_state_copy_does_not_wait_and_survives_its_slots_reuse(tmp_path):
    """A chain's turn ends with its states copied to host memory on a side stream (an event on the saved state,
    the slot marked as read); a stateless request that takes the freed slot at once and runs (writing the slot)
    leaves the saved copy intact: the chain's next turn gives the CPU engine's tokens for the whole history."""
    import random

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.tiny_checkpoint import make_tiny_checkpoint
    from tests.chain_helpers import random_tokens, run_chain_turn

    model = make_tiny_checkpoint(tmp_path / "qwen3_next", "qwen3_next", seed=7, hidden_size=128, num_heads=4,
                                 num_kv_heads=2, intermediate_size=192, vocab_size=512, head_dim=32,
                                 partial_rotary_factor=0.5, linear_key_head_dim=64, linear_value_head_dim=64,
                                 max_position_embeddings=1024, initializer_range=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rng = random.Random(11)
    first, other, second = random_tokens(rng, 150), random_tokens(rng, 120), random_tokens(rng, 40)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, device=device, dtype="float32", page_size=16, num_pages=128, max_num_batched_tokens=128,
                  enable_prefix_caching=False)
        engine = llm.engine
        turn1 = run_chain_turn(engine, "c", first, params).token_ids
        state = engine.chains.index.get("c").table.state
        if device == "cuda":
            assert state.done is not None and engine.cache.storage._copying  # queued, not waited for
        # the only free slots include the chain's: a stateless request in between takes and writes one
        stateless = llm.generate([other], params)[0].token_ids
        turn2 = run_chain_turn(engine, "c", second, params).token_ids
        outputs[device] = (turn1, stateless, turn2)
        llm.close()
    assert outputs["cuda"] == outputs["cpu"]
