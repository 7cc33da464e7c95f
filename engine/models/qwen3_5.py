"""Qwen3.5 text models: the hybrid decoder of ``engine.models.gated_deltanet`` (gated DeltaNet and gated full
attention layers) with a SwiGLU MLP on every layer. Read from transformers' ``modeling_qwen3_5.py``.

``Qwen3_5ForConditionalGeneration`` is the vision-language checkpoint: its config.json nests the text model under
``text_config`` (ModelConfig reads it from there) and its weights under ``model.language_model.*``; the engine
runs the text model alone (text-only positions: multimodal RoPE is plain RoPE, see
``model_config_linear.hybrid_fields``), and the vision tower ``model.visual.*`` is skipped at load with a log line.
"""

from engine.models.gated_deltanet import SPLIT_LAYOUT, HybridForCausalLM


class Qwen3_5ForCausalLM(HybridForCausalLM):
    checkpoint_layout = SPLIT_LAYOUT


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    pass
