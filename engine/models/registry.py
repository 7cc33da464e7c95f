"""Architecture name (config.json ``architectures[0]``) -> model class, imported on first use."""

import importlib

from engine.errors import UnsupportedArchitectureError

_MODEL_CLASS_PATHS: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama",
    "Qwen2ForCausalLM": "engine.models.qwen2",
    "Qwen3ForCausalLM": "engine.models.qwen3",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe",
    "Qwen2MoeForCausalLM": "engine.models.qwen2_moe",
    "DeepseekV3ForCausalLM": "engine.models.deepseek_v3",
    "Glm4MoeLiteForCausalLM": "engine.models.glm4_moe_lite",
    "Qwen3NextForCausalLM": "engine.models.qwen3_next",
    "Qwen3_5ForCausalLM": "engine.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "engine.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "engine.models.qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "engine.models.qwen3_5_moe",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASS_PATHS)


def check_supported(architecture: str) -> None:
    if architecture not in _MODEL_CLASS_PATHS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def get_model_class(architecture: str) -> type:
    check_supported(architecture)
    module = importlib.import_module(_MODEL_CLASS_PATHS[architecture])
    return getattr(module, architecture)
