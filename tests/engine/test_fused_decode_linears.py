"""``EngineConfig.fused_decode_linears``: steps of at most ``decode_linear.MAX_ROWS`` tokens run each RMSNorm
inside the projection after it and SiLU-and-mul inside the down projection (agentrt_kernels.triton.decode_linear).

Reference: the same engine without it (the unfused layers, which the engine tests check against HF
transformers). fp32 on the CPU through Triton's interpreter: the same greedy tokens, log-probabilities to
fp32 summation order, for every architecture (Qwen2's QKV bias, Qwen3's q/k norms, Qwen3-MoE's router after
the fused norm, latent attention's two low-rank norms), and the fused kernel must really run.
"""

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import agentrt_kernels.triton.decode_linear as decode_linear_module  # noqa: E402
from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.errors import ConfigError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def prompts(lens=(9, 23, 14)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def record_calls(monkeypatch, note):
    """Every ``decode_linear`` call goes through ``note(x, weight, keywords)`` first."""
    inner = decode_linear_module.decode_linear

    def recording(x, weight, *args, **kw):
        note(x, weight, kw)
        return inner(x, weight, *args, **kw)

    monkeypatch.setattr(decode_linear_module, "decode_linear", recording)


def assert_fused_equals_unfused(model_dir, prompt_lens, max_tokens, **engine_kw):
    """Greedy generation without, then with, the fused path: the same tokens, log-probabilities to fp32
    summation order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    outs = []
    for fused in (False, True):
        llm = LLM(model_dir, dtype="float32", device=DEVICE, page_size=4, fused_decode_linears=fused, **engine_kw)
        outs.append(llm.generate(prompts(prompt_lens), params))
    ref, got = outs
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(ref, got):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("eager", [True] if DEVICE == "cpu" else [True, False], ids=lambda e: "eager" if e else "graphs")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe_lite"])
def test_fused_decode_linears_equal_the_unfused_layers(tiny_dirs, arch, eager, monkeypatch):
    calls = []

    def counting(x, weight, kw):
        kind = ("silu" if kw.get("silu_mul") else "router" if kw.get("return_normed") else
                "norm" if kw.get("norm") else "o_proj")
        calls.append((kind, x.shape[0], weight.shape[1]))

    record_calls(monkeypatch, counting)
    assert_fused_equals_unfused(tiny_dirs[arch], (9, 23, 14), 6, max_num_batched_tokens=16, enforce_eager=eager,
                                num_pages=256)
    kinds = {k for k, _, _ in calls}  # (decode graphs: the calls of their capture)
    # latent attention: the input norm in q_a / kv_a's projection, q_a's norm in q_b's, o_proj; its dense first
    # layer's SiLU-and-mul; its MoE layers' router runs the post-attention norm itself (no decode_linear)
    assert kinds == ({"norm", "o_proj", "router"} if arch == "qwen3_moe" else {"norm", "o_proj", "silu"})
    if arch == "glm4_moe_lite":  # q_b after q_a's norm: K is the query's low rank
        q_lora_rank = json.loads((Path(tiny_dirs[arch]) / "config.json").read_text())["q_lora_rank"]
        assert ("norm", q_lora_rank) in {(kind, k) for kind, _, k in calls}
    assert calls and max(rows for _, rows, _ in calls) <= decode_linear_module.MAX_ROWS


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "glm4_moe_lite"])
def test_steps_of_17_to_32_tokens_take_the_32_row_tile(tiny_dirs, arch, monkeypatch):
    """Steps past 16 tokens (here prompt chunks of up to 32) run the fused path on a 32-row dot tile: the same
    greedy tokens and log-probabilities as the unfused layers (the per-head products at those rows:
    tests/kernels/test_head_matmul.py)."""
    rows = []
    record_calls(monkeypatch, lambda x, weight, kw: rows.append(x.shape[0]))
    assert_fused_equals_unfused(tiny_dirs[arch], (27, 9), 4, max_num_batched_tokens=32, enforce_eager=True,
                                num_pages=256)
    assert any(16 < r <= decode_linear_module.MAX_ROWS for r in rows), rows


def test_latent_attention_one_row_steps_equal_the_unfused_layers(tiny_dirs, monkeypatch):
    """One request: its decode steps are single rows, which take the register (FMA) launch, q_b's operand a
    strided view of the merged projection's output."""
    launches = []

    def recording(x, weight, kw):
        if x.shape[0] == 1:
            launches.append(decode_linear_module.tuned_launch(weight.shape[0], weight.shape[1], 1, x.device,
                                                              x.element_size()))

    record_calls(monkeypatch, recording)
    assert_fused_equals_unfused(tiny_dirs["glm4_moe_lite"], (11,), 5, max_num_batched_tokens=16, enforce_eager=True,
                                num_pages=64)
    assert launches and all(launch.get("FMA") for launch in launches)


def test_latent_attention_without_a_low_rank_query_has_no_fused_path(tiny_dirs):
    """The tiny DeepSeek-V3 has no q_lora_rank (DeepSeek-V2-Lite's layout): no merged input projection for the
    input norm to run in, so asking for the fused path is refused, and the default leaves it off."""
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM has no fused decode path"):
        LLM(tiny_dirs["deepseek_v3"], dtype="float32", device=DEVICE, fused_decode_linears=True, num_pages=64)
    llm = LLM(tiny_dirs["deepseek_v3"], dtype="float32", device=DEVICE, num_pages=64)
    assert llm.engine.model.model.fused_decode_rows == 0


def test_bad_values(tiny_dirs):
    with pytest.raises(ConfigError, match="fused_decode_linears must be"):
        EngineConfig(tiny_dirs["qwen3"], fused_decode_linears="yes")
    with pytest.raises(ConfigError, match="fused_decode_linears needs tensor_parallel_size 1"):
        EngineConfig(tiny_dirs["qwen3"], fused_decode_linears=True, tensor_parallel_size=2)
