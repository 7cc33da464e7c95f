import pytest
import torch

torch.set_num_threads(1)


def _tiny_set(root, initializer_range: float, hidden_size: int = 64) -> dict:
    from engine.tiny_checkpoint import make_tiny_checkpoint

    common = dict(hidden_size=hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=2 * hidden_size, vocab_size=512, max_position_embeddings=1024,
                  initializer_range=initializer_range)
    return {
        "llama": make_tiny_checkpoint(root / "llama", "llama", seed=1, **common,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=2, **common, tie_word_embeddings=True),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", seed=3, **common, head_dim=hidden_size // 2,
                                      max_shard_size="100KB"),
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=4, **common, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32),
    }


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, mla_dirs, hybrid_dirs):
    """One small random checkpoint per supported architecture, written by the project's factory."""
    return _tiny_set(tmp_path_factory.mktemp("tiny"), 0.1) | mla_dirs | hybrid_dirs


@pytest.fixture(scope="session")
def hybrid_dirs(tmp_path_factory):
    """The hybrid linear-attention architectures, small and random: 4 layers, full attention every second."""
    from engine.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hybrid")
    common = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                  max_position_embeddings=1024, initializer_range=0.1)
    return {
        "qwen3_next": make_tiny_checkpoint(root / "qwen3_next", "qwen3_next", seed=7, **common, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32),
        "qwen3_5": make_tiny_checkpoint(root / "qwen3_5", "qwen3_5", seed=8, **common),
        "qwen3_5_moe": make_tiny_checkpoint(root / "qwen3_5_moe", "qwen3_5_moe", seed=9, **common, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32),
    }


MLA_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


@pytest.fixture(scope="session")
def mla_dirs(tmp_path_factory):
    """The latent-attention architectures, small and random: DeepSeek-V3 with a full query projection,
    half-split RoPE under YaRN (mscale in the softmax scale), expert groups and a dense first layer; GLM-4.7-Flash
    with a low-rank query and interleaved RoPE."""
    from engine.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("mla")
    common = dict(hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128, vocab_size=512,
                  max_position_embeddings=1024, initializer_range=0.1, moe_intermediate_size=32,
                  kv_lora_rank=32, qk_rope_head_dim=8)
    return {
        "deepseek_v3": make_tiny_checkpoint(root / "deepseek_v3", "deepseek_v3", seed=5, **common, num_experts=8,
                                            num_experts_per_tok=2, n_group=4, topk_group=2, q_lora_rank=None,
                                            rope_interleave=False, rope_scaling=MLA_YARN),
        "glm4_moe_lite": make_tiny_checkpoint(root / "glm4_moe_lite", "glm4_moe_lite", seed=6, **common,
                                              num_experts=4, num_experts_per_tok=2, q_lora_rank=48),
    }


@pytest.fixture(scope="session")
def tiny_dirs_hf_init(tmp_path_factory):
    """The same architectures drawn at transformers' default initializer_range (0.02), with 64-wide heads
    (hidden 256; flashinfer's kernels need head_dim 64/128/256). The 0.1 set is so sensitive that a 1e-3
    relative perturbation of the attention output moves its bf16 logits by ~1e-2 (docs/benchmarks.md, "bf16
    agreement"), so bf16 comparisons between backends use this set."""
    return _tiny_set(tmp_path_factory.mktemp("tiny-hf-init"), 0.02, hidden_size=256)


@pytest.fixture(scope="session")
def make_llm(tiny_dirs):
    """``make_llm(arch, **overrides)``: an LLM on ``arch``'s tiny checkpoint, in float32 on the CPU unless
    ``overrides`` (any other LLM option: page size, pages, chunk, method, ...) say otherwise."""
    from engine import LLM

    def make(arch: str, **overrides):
        return LLM(tiny_dirs[arch], **{"dtype": "float32", "device": "cpu", **overrides})

    return make


@pytest.fixture(scope="session")
def tiny_llms(tiny_dirs, make_llm):
    """A roomy engine on the tiny Qwen3 checkpoint (no chunking, no memory pressure) and its directory."""
    return make_llm("qwen3", page_size=4, max_num_batched_tokens=4096), tiny_dirs["qwen3"]
