"""Our decoder models vs transformers on tiny random checkpoints, plus loader/config error paths."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.models.layers import RotaryEmbedding

VOCAB = 300
SEQ_LEN = 12
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attn_implementation="eager",
)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)

CASES = {
    "llama": ("Llama", {}),
    "llama_bias_llama3_rope": ("Llama", dict(attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE)),
    "llama_tied_linear_rope": (
        "Llama",
        dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "qwen2": ("Qwen2", {}),
    "qwen3_wide_head_yarn": ("Qwen3", dict(head_dim=32, rope_parameters=YARN_ROPE)),
    "qwen3_moe_norm_topk": ("Qwen3Moe", dict(MOE, norm_topk_prob=True)),
    "qwen3_moe_sparse_step": (
        "Qwen3Moe",
        dict(MOE, num_experts=4, norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=2),
    ),
    "qwen3_moe_mlp_only_layers": ("Qwen3Moe", dict(MOE, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe_shared_expert": ("Qwen2Moe", dict(MOE, shared_expert_intermediate_size=48, num_hidden_layers=3)),
}


class DenseCausalRunner:
    """Single-sequence causal attention in plain torch (GQA by repeat_interleave), fp32 softmax like HF."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self) -> None:
        self.ended_layers: list[int] = []

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def end_layer(self, layer_idx: int, hidden: torch.Tensor) -> None:
        self.ended_layers.append(layer_idx)


def build_hf_model(family: str, **overrides) -> transformers.PreTrainedModel:
    config = getattr(transformers, f"{family}Config")(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
    return model


def random_input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(seed))


def our_logits(model, input_ids: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[0]) + position_offset
    runner = DenseCausalRunner()
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, runner))
    assert runner.ended_layers == list(range(model.config.num_layers))
    return logits


def hf_logits(hf_model, input_ids: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
    positions = (torch.arange(input_ids.shape[0]) + position_offset)[None]
    with torch.no_grad():
        return hf_model(input_ids[None], position_ids=positions).logits[0].float()


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor, atol: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("case", CASES)
def test_fp32_logits_match_hf(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    hf_model = build_hf_model(family, **overrides)
    hf_model.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.architecture == f"{family}ForCausalLM"
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in model.parameters())
    input_ids = random_input_ids()
    assert_logits_match(our_logits(model, input_ids), hf_logits(hf_model, input_ids))


def test_sharded_checkpoint_with_index_and_position_offset(tmp_path: Path) -> None:
    hf_model = build_hf_model("Llama", rope_parameters=LLAMA3_ROPE)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_model(tmp_path)
    input_ids = random_input_ids()
    assert_logits_match(our_logits(model, input_ids, 100), hf_logits(hf_model, input_ids, 100))


def test_fused_expert_keys_load(tmp_path: Path) -> None:
    hf_model = build_hf_model("Qwen3Moe", **MOE, norm_topk_prob=True)
    hf_model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    model, _ = load_model(tmp_path)
    input_ids = random_input_ids()
    assert_logits_match(our_logits(model, input_ids), hf_logits(hf_model, input_ids))


@pytest.mark.parametrize("case", ["qwen3_wide_head_yarn", "qwen2_moe_shared_expert"])
def test_bf16_load_and_forward(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    hf_model = build_hf_model(family, **overrides)
    hf_model.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in [*model.parameters(), *model.buffers()])
    input_ids = random_input_ids()
    ours = our_logits(model, input_ids)
    theirs = hf_logits(hf_model.to(torch.bfloat16), input_ids)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    "rope_parameters", [dict(rope_theta=10000.0, rope_type="default"), LLAMA3_ROPE, YARN_ROPE,
                        dict(rope_type="linear", rope_theta=10000.0, factor=2.0)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_exact_with_hf(rope_parameters: dict, dtype: torch.dtype) -> None:
    hf_config = transformers.LlamaConfig(**{**COMMON, "rope_parameters": dict(rope_parameters)})
    config = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q = torch.randn(len(positions), 4, config.head_dim, dtype=dtype)
    k = torch.randn(len(positions), 2, config.head_dim, dtype=dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
    finally:
        torch.set_default_dtype(previous)
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)(q, positions[None])
    hf_q, hf_k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    ours_q, ours_k = rotary(positions, q, k)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


def test_config_old_style_keys_and_generation_eos(tmp_path: Path) -> None:
    old_style = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        torch_dtype="bfloat16",
        eos_token_id=5,
        bos_token_id=1,
    )
    (tmp_path / "config.json").write_text(json.dumps(old_style))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.rope_theta == 1e6 and config.rope_scaling["rope_type"] == "yarn"
    assert config.num_experts == 8 and config.qk_norm and not config.attention_bias
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert config.head_dim == 16 and config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == (5, 7) and config.bos_token_id == 1
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 4 * 2 * 16 * 2
    qwen2 = ModelConfig.from_hf_dict({**old_style, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.rope_scaling is None


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    build_hf_model("Llama").save_pretrained(tmp_path)
    return tmp_path


def rewrite_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))


def rewrite_weights(model_dir: Path, edit) -> None:
    state = load_file(model_dir / "model.safetensors")
    edit(state)
    save_file(state, model_dir / "model.safetensors")


def test_missing_dir_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(tmp_path)


def test_broken_config_json_raises(llama_dir: Path) -> None:
    (llama_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        load_model(llama_dir)


def test_config_missing_key_raises(llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    del config["hidden_size"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(llama_dir)


def test_unsupported_architecture_raises(llama_dir: Path) -> None:
    rewrite_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        load_model(llama_dir)


def test_unsupported_rope_type_raises(llama_dir: Path) -> None:
    rewrite_config(llama_dir, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="dynamic"):
        load_model(llama_dir)


def test_unsupported_dtype_raises(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not supported"):
        load_model(llama_dir, dtype=torch.int8)


def test_missing_tensor_raises(llama_dir: Path) -> None:
    rewrite_weights(llama_dir, lambda state: state.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(llama_dir)


def test_unexpected_tensor_raises(llama_dir: Path) -> None:
    rewrite_weights(llama_dir, lambda state: state.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_model(llama_dir)


def test_shape_mismatch_raises(llama_dir: Path) -> None:
    rewrite_weights(llama_dir, lambda state: state.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(63,\)"):
        load_model(llama_dir)


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    build_hf_model("Qwen3Moe", **MOE).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda state: state.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(tmp_path)


def test_no_weight_files_raises(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(llama_dir)


def test_dummy_load_format_needs_no_weight_files(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    first, _ = load_model(llama_dir, load_format="dummy")
    second, _ = load_model(llama_dir, load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert torch.isfinite(our_logits(first, random_input_ids())).all()
    with pytest.raises(ConfigError, match="load_format"):
        load_model(llama_dir, load_format="pt")
