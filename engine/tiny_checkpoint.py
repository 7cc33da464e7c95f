"""Tiny Hugging Face checkpoints: the embedded trained model, and seeded random ones for tests and examples.

``embedded_model_dir()`` is the default model of every command: a tiny Qwen3 trained on long-context
retrieval, shipped as package data (docs/quality.md). Random checkpoints are built locally: a byte-level BPE
tokenizer trained on an embedded corpus, a ChatML chat template with tool calling (Qwen2.5 style), and a
model of one of the supported architectures whose weights depend only on the arguments.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.cli_args import CommandLineParser, json_object, positive_int, usage_error
from engine.errors import ConfigError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EXTRA_ADDED_TOKENS = (TOOL_CALL_START, TOOL_CALL_END)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_5", "qwen3_5_moe",
                   "qwen3_next")
MLA_ARCHS = ("deepseek_v3", "glm4_moe_lite")  # latent attention with the DeepSeek MoE block
# gated DeltaNet (linear attention) layers with gated full-attention ones every ``full_attention_interval`` layers
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
HYBRID_NUM_LAYERS = 4  # default depth of a hybrid checkpoint: linear and full-attention layers both repeat
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
VOCAB_PAD_MULTIPLE = 64
CHECKPOINT_FORMAT_VERSION = 1

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "data" / "qwen3-tiny-trained"

DEFAULT_MODEL_NAME = "qwen3-tiny"
DEFAULT_MODEL_ARGS: dict[str, Any] = {
    "arch": "qwen3",
    "seed": 0,
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "rope_theta": 1000000.0,
}

CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful assistant.' -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_PROSE = """\
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of tokens and
predicts the next one, one step at a time. When the request arrives, the scheduler decides which
sequences run in the next batch, how many pages of the key and value cache each one needs, and when a
finished sequence gives its memory back to the pool.
It was a bright cold day in April, and the clocks were striking thirteen. The river ran fast under the
old stone bridge, and the children counted the boats as they passed: one, two, three, four, five.
In the morning the baker opened the shop at six o'clock; by noon the bread was gone and the shelves
were empty again. People said the weather would change before the weekend, but nobody knew for sure.
Science is a way of thinking much more than it is a body of knowledge. Good inquiries matter as much as
good answers, and a careful experiment is worth more than a thousand confident opinions.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 4096 3.14159 2.71828 -1 1e-6 50% $19.99 #1 @home
Punctuation and symbols: ( ) [ ] { } < > ! ? , . ; : ' " ` ~ + - * / = % & | ^ _ \\ @ # $
Unicode: café naïve résumé façade über straße 東京 北京 こんにちは 안녕하세요 Привет мир γειά σου 🙂 🚀 ✓ → ∑ π
"""

_CODE = '''\
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    output_token_ids: list[int] = field(default_factory=list)

    def is_finished(self, eos_token_id: int) -> bool:
        if len(self.output_token_ids) >= self.max_tokens:
            return True
        return bool(self.output_token_ids) and self.output_token_ids[-1] == eos_token_id


def softmax(values: Iterable[float]) -> list[float]:
    values = list(values)
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(num_pages))

    def allocate(self, count: int) -> Optional[list[int]]:
        if count > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:count], self.free_pages[count:]
        return pages

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)


def main() -> None:
    pool = PagePool(num_pages=128, page_size=16)
    for index in range(10):
        pages = pool.allocate(index + 1)
        print(f"request {index}: pages={pages}")
    print(json.dumps({"status": "ok", "free": len(pool.free_pages)}, indent=2))


if __name__ == "__main__":
    main()
'''

_CHAT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
What's the weather like in Tokyo today?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21, "condition": "sunny", "humidity": 0.4}
</tool_response><|im_end|>
<|im_start|>assistant
It is sunny in Tokyo, about 21 degrees Celsius with low humidity.<|im_end|>
<|im_start|>user
Can you write a function that reverses a string in Python?<|im_end|>
<|im_start|>assistant
Sure! Here is a simple version:

```python
def reverse(text: str) -> str:
    return text[::-1]
```

You can call it like `reverse("hello")`, which returns `"olleh"`.<|im_end|>
<|im_start|>user
Search the web for the latest release notes, please.<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "web_search", "arguments": {"query": "latest release notes", "max_results": 3}}
</tool_call><|im_end|>
<|im_start|>user
Thanks, that's all for now.<|im_end|>
<|im_start|>assistant
You're welcome! Let me know if you need anything else.<|im_end|>
<|endoftext|>
"""

TRAINING_CORPUS = "\n".join([_PROSE, _CODE, _CHAT])


def _training_lines() -> list[str]:
    return [line + "\n" for line in TRAINING_CORPUS.splitlines()]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    added_count = len(SPECIAL_TOKENS) + len(EXTRA_ADDED_TOKENS)
    base_alphabet = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < base_alphabet + added_count:
        raise ConfigError(f"vocab_size must be at least {base_alphabet + added_count}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added_count,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_ADDED_TOKENS])
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens; identical for the same vocab_size.

    Training is memoized per process; every call returns a fresh object, so callers may mutate it.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _model_vocab_size(requested: int, tokenizer_length: int) -> int:
    if tokenizer_length <= requested:
        return requested
    return _round_up(tokenizer_length, VOCAB_PAD_MULTIPLE)


def _rope_parameters(rope_theta: float, rope_scaling: dict | None) -> dict:
    scaling = dict(rope_scaling or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    return {"rope_theta": float(rope_theta), **scaling}


def _validate_shape(arch: str, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None, dtype: str) -> int:
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    resolved_head_dim = head_dim if head_dim is not None else hidden_size // num_heads
    if resolved_head_dim <= 0 or resolved_head_dim % 2:
        raise ConfigError(f"head_dim must be a positive even number, got {resolved_head_dim}")
    if arch == "qwen2" and resolved_head_dim * num_heads != hidden_size:
        raise ConfigError("qwen2 requires head_dim == hidden_size // num_heads")
    return resolved_head_dim


def _hybrid_config(arch: str, common: dict[str, Any], moe: dict[str, Any], head_dim: int, hybrid: dict[str, Any]):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    hybrid = dict(hybrid)
    if hybrid.get("layer_types") is None:
        hybrid.pop("layer_types", None)
    else:
        hybrid.pop("full_attention_interval")
    factor = hybrid.pop("partial_rotary_factor")
    shared = hybrid.pop("shared_expert_intermediate_size")
    common = {**common, "rope_parameters": {**common["rope_parameters"], "partial_rotary_factor": factor}}
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, **hybrid, head_dim=head_dim, architectures=["Qwen3_5ForCausalLM"])
    moe = {k: v for k, v in moe.items() if arch == "qwen3_next" or k != "norm_topk_prob"}  # 3.5: always renormalized
    if arch == "qwen3_5_moe":
        common = {k: v for k, v in common.items() if k != "intermediate_size"}
        return Qwen3_5MoeTextConfig(**common, **moe, **hybrid, head_dim=head_dim,
                                    shared_expert_intermediate_size=shared, architectures=["Qwen3_5MoeForCausalLM"])
    return Qwen3NextConfig(**common, **moe, **hybrid, head_dim=head_dim, shared_expert_intermediate_size=shared,
                           architectures=["Qwen3NextForCausalLM"])


def _perturb_hybrid(model) -> None:
    """transformers starts the zero-centred norms at 0 (a scale of 1), the DeltaNet's gated norm at 1 and dt_bias at
    1: random values around those make the checkpoint exercise every scale, as a trained one does."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                param.normal_(1.0, 0.2)
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)


def _build_config(arch: str, common: dict[str, Any], moe: dict[str, Any], head_dim: int,
                  mla: dict[str, Any] | None = None, hybrid: dict[str, Any] | None = None):
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch in HYBRID_ARCHS:
        assert hybrid is not None
        return _hybrid_config(arch, common, moe, head_dim, hybrid)
    if arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=head_dim, architectures=["Qwen3MoeForCausalLM"])
    assert mla is not None
    deepseek_moe = dict(n_routed_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                        moe_intermediate_size=moe["moe_intermediate_size"], norm_topk_prob=moe["norm_topk_prob"])
    common = {k: v for k, v in common.items() if k != "num_key_value_heads"}  # one latent row, not KV heads
    if arch == "deepseek_v3":
        return DeepseekV3Config(**common, **deepseek_moe, **mla, architectures=["DeepseekV3ForCausalLM"])
    mla = {k: v for k, v in mla.items() if k != "first_k_dense_replace"}
    return Glm4MoeLiteConfig(**common, **deepseek_moe, **mla, architectures=["Glm4MoeLiteForCausalLM"])


def _special_token_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + EXTRA_ADDED_TOKENS}


def _instantiate_seeded(config, seed: int, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # HF starts DeepSeek routers' correction bias at zero; random values make it choose experts, as trained
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
        if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
            _perturb_hybrid(model)
    return model.to(getattr(torch, dtype)).eval()


def _write_generation_config(out_dir: Path, ids: dict[str, int]) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    ).save_pretrained(out_dir)


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    initializer_range: float = 0.02,
    dtype: str = "float32",
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    kv_lora_rank: int = 32,
    q_lora_rank: int | None = 48,
    qk_rope_head_dim: int = 8,
    n_group: int = 1,
    topk_group: int = 1,
    first_k_dense_replace: int = 1,
    rope_interleave: bool = True,
    full_attention_interval: int = 2,
    layer_types: list[str] | None = None,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    partial_rotary_factor: float = 0.25,
    shared_expert_intermediate_size: int = 32,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random-initialised HF checkpoint (config, safetensors, tokenizer, generation config) to out_dir.

    MLA architectures (``MLA_ARCHS``) take ``num_heads``, ``head_dim`` as the no-RoPE query / key and the value
    head size, ``kv_lora_rank``, ``q_lora_rank`` (None: a full query projection), ``qk_rope_head_dim``, the
    expert groups and the dense first layers; ``num_kv_heads`` does not apply.

    Hybrid architectures (``HYBRID_ARCHS``, ``HYBRID_NUM_LAYERS`` layers unless ``num_layers`` says) take the gated
    DeltaNet's sizes (``linear_*``), ``layer_types`` or else ``full_attention_interval``, ``partial_rotary_factor``
    and (MoE ones) ``shared_expert_intermediate_size``; other architectures default to 2 layers."""
    if num_layers is None:
        num_layers = HYBRID_NUM_LAYERS if arch in HYBRID_ARCHS else 2
    if arch in MLA_ARCHS:
        num_kv_heads = num_heads
    resolved_head_dim = _validate_shape(arch, hidden_size, num_heads, num_kv_heads, head_dim, dtype)
    if arch in HYBRID_ARCHS and (linear_num_value_heads % linear_num_key_heads or full_attention_interval <= 0):
        raise ConfigError(f"linear_num_value_heads ({linear_num_value_heads}) must be a multiple of "
                          f"linear_num_key_heads ({linear_num_key_heads}) and full_attention_interval positive")
    if arch in ("qwen3_moe", "qwen3_5_moe", "qwen3_next", *MLA_ARCHS) and not 0 < num_experts_per_tok <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({num_experts_per_tok}) must be in 1..num_experts ({num_experts})")
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.model_max_length = max_position_embeddings
    ids = _special_token_ids(tokenizer)
    common = {
        "vocab_size": _model_vocab_size(vocab_size, len(tokenizer)),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": _rope_parameters(rope_theta, rope_scaling),
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "dtype": dtype,
    }
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
    }
    mla = dict(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
               qk_nope_head_dim=resolved_head_dim, v_head_dim=resolved_head_dim, n_group=n_group,
               topk_group=topk_group, first_k_dense_replace=first_k_dense_replace, rope_interleave=rope_interleave)
    hybrid = dict(full_attention_interval=full_attention_interval, layer_types=layer_types,
                  linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
                  linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
                  linear_conv_kernel_dim=linear_conv_kernel_dim, partial_rotary_factor=partial_rotary_factor,
                  shared_expert_intermediate_size=shared_expert_intermediate_size)
    config = _build_config(arch, common, moe, resolved_head_dim, mla, hybrid)
    model = _instantiate_seeded(config, seed, dtype)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_path, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(out_path)
    _write_generation_config(out_path, ids)
    return out_path


def _cache_root() -> Path:
    configured = os.environ.get("AGENTRT_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "agentrt"
    return base / "models"


def _args_digest(args: dict[str, Any]) -> str:
    import tokenizers
    import torch
    import transformers

    payload = {
        "args": args,
        "format": CHECKPOINT_FORMAT_VERSION,
        "template": CHAT_TEMPLATE,
        "corpus": TRAINING_CORPUS,
        "versions": [transformers.__version__, tokenizers.__version__, torch.__version__.split("+")[0]],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_checkpoint_dir(name: str, **kwargs: Any) -> Path:
    """Build make_tiny_checkpoint(**kwargs) once into the cache (atomically) and return its directory."""
    final_dir = _cache_root() / f"{name}-{_args_digest(kwargs)}"
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        make_tiny_checkpoint(staging_dir, **kwargs)
        os.rename(staging_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir


def embedded_model_dir() -> Path:
    """The embedded default model: a tiny Qwen3 trained on long-context retrieval (package data; docs/quality.md)."""
    return EMBEDDED_MODEL_DIR


def random_model_dir() -> Path:
    """A small random qwen3 for tests, built on first use into the cache and reused afterwards."""
    return cached_checkpoint_dir(DEFAULT_MODEL_NAME, **DEFAULT_MODEL_ARGS)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandLineParser(prog="agentrt make-tiny", description=(
        "Write a seeded random Hugging Face checkpoint of a supported architecture: config.json,\n"
        "safetensors, a locally trained tokenizer and a ChatML chat template with tool calls."))
    parser.add_argument("--arch", default="llama", choices=SUPPORTED_ARCHS, help="the architecture")
    parser.add_argument("--out", required=True, type=Path, help="the directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--vocab-size", type=positive_int, default=512,
                        help="tokenizer vocabulary (the model's is padded to a multiple of 64)")
    parser.add_argument("--hidden-size", type=positive_int, default=64, help="model width")
    parser.add_argument("--num-layers", type=positive_int, default=None,
                        help=f"decoder layers (default: {HYBRID_NUM_LAYERS} for {', '.join(HYBRID_ARCHS)}, else 2)")
    parser.add_argument("--num-heads", type=positive_int, default=4, help="query heads")
    parser.add_argument("--num-kv-heads", type=positive_int, default=2, help="key/value heads (divides --num-heads)")
    parser.add_argument("--head-dim", type=positive_int, default=None,
                        help="size of one head (default: hidden size / heads)")
    parser.add_argument("--intermediate-size", type=positive_int, default=128, help="MLP width (dense architectures)")
    parser.add_argument("--max-position-embeddings", type=positive_int, default=2048, help="the longest context")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="share the embedding and output matrices")
    parser.add_argument("--rope-scaling", type=json_object, default=None,
                        help="JSON object, e.g. '{\"rope_type\": \"linear\", \"factor\": 2.0}' (default: none)")
    parser.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")
    parser.add_argument("--initializer-range", type=float, default=0.02, help="std of the random weights")
    parser.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES, help="dtype of the weights")
    parser.add_argument("--num-experts", type=positive_int, default=4, help="experts per MoE layer (qwen3_moe)")
    parser.add_argument("--num-experts-per-tok", type=positive_int, default=2, help="experts routed per token (qwen3_moe)")
    parser.add_argument("--moe-intermediate-size", type=positive_int, default=32, help="expert MLP width (qwen3_moe)")
    parser.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false",
                        help="do not renormalise the routed experts' weights (qwen3_moe)")
    parser.add_argument("--kv-lora-rank", type=positive_int, default=32, help="latent rank (deepseek_v3, glm4_moe_lite)")
    parser.add_argument("--q-lora-rank", type=positive_int, default=48,
                        help="query low rank (deepseek_v3, glm4_moe_lite)")
    parser.add_argument("--qk-rope-head-dim", type=positive_int, default=8,
                        help="shared rotary key width (deepseek_v3, glm4_moe_lite; --head-dim is the rest of a head)")
    parser.add_argument("--full-attention-interval", type=positive_int, default=2,
                        help="every n-th layer is full attention, the others linear (qwen3_5, qwen3_5_moe, qwen3_next)")
    parser.add_argument("--linear-num-key-heads", type=positive_int, default=2,
                        help="gated DeltaNet query/key heads (hybrid archs)")
    parser.add_argument("--linear-num-value-heads", type=positive_int, default=4,
                        help="gated DeltaNet value heads, a multiple of the key heads (hybrid archs)")
    parser.add_argument("--shared-expert-intermediate-size", type=positive_int, default=32,
                        help="shared expert MLP width (qwen3_5_moe, qwen3_next)")
    parser.add_argument("--max-shard-size", default=None,
                        help="split the safetensors into shards of at most this size, e.g. 1MB (default: one file)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = vars(_parse_args(argv))
    out_dir = args.pop("out")
    try:
        print(make_tiny_checkpoint(out_dir, **args))
    except ConfigError as exc:
        return usage_error("agentrt make-tiny", exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
