import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import tiny_checkpoint
from engine.errors import ConfigError
from benchmarks.model_shapes import SHAPES, get_shape
from engine.tiny_checkpoint import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    SUPPORTED_ARCHS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    random_model_dir,
    make_tiny_checkpoint,
    train_tokenizer,
)

EXPECTED_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tok"), "qwen3", num_layers=1)
    return AutoTokenizer.from_pretrained(checkpoint)


def load_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_each_arch_writes_and_reloads_with_transformers(tmp_path, arch):
    checkpoint = make_tiny_checkpoint(tmp_path, arch, seed=1)

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    assert model.config.architectures == [EXPECTED_ARCHITECTURE[arch]]
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    input_ids = torch.tensor([tokenizer.encode("hello world")])
    logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, tokenizer.pad_token_id]


def test_weights_are_saved_in_hub_layout_for_moe(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_experts=4)
    names = set(load_tensors(checkpoint))
    assert "model.layers.0.mlp.gate.weight" in names
    assert {f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)} <= names


def test_tied_embeddings_omit_lm_head(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_tensors(checkpoint)
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.tie_word_embeddings


def test_dtype_is_applied(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "llama", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in load_tensors(checkpoint).values())
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"


def test_same_seed_gives_identical_files_and_different_seed_differs(tmp_path):
    first = make_tiny_checkpoint(tmp_path / "a", "llama", seed=7)
    again = make_tiny_checkpoint(tmp_path / "b", "llama", seed=7)
    other = make_tiny_checkpoint(tmp_path / "c", "llama", seed=8)

    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    first_tensors, other_tensors = load_tensors(first), load_tensors(other)
    assert first_tensors.keys() == other_tensors.keys()
    assert not torch.equal(first_tensors["model.embed_tokens.weight"], other_tensors["model.embed_tokens.weight"])


def test_writing_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_checkpoint(tmp_path, "llama", num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_max_shard_size_writes_index_with_several_shards(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "llama", max_shard_size="100KB")

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 1
    assert all((checkpoint / name).is_file() for name in shard_files)
    assert set(index["weight_map"]) == set(load_tensors(checkpoint))
    AutoModelForCausalLM.from_pretrained(checkpoint)


def test_tokenizer_special_tokens():
    tokenizer = train_tokenizer(512)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)]

    assert len(tokenizer) == 512
    assert len(set(ids)) == 5 and all(0 <= i < 512 for i in ids)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.encode(f"{TOOL_CALL_START}x{TOOL_CALL_END}{IM_END}") == [ids[3], *tokenizer.encode("x"), ids[4], ids[2]]
    assert TOOL_CALL_START in tokenizer.decode([ids[3]], skip_special_tokens=True)


def test_tokenizer_is_deterministic_and_memoized_copies_are_independent():
    first, second = train_tokenizer(300), train_tokenizer(300)
    assert first is not second
    assert first.get_vocab() == second.get_vocab()
    first.add_tokens(["<extra>"])
    assert "<extra>" not in train_tokenizer(300).get_vocab()


def test_vocab_size_too_small_is_config_error():
    with pytest.raises(ConfigError):
        train_tokenizer(100)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_arbitrary_unicode(saved_tokenizer, text):
    assert saved_tokenizer.decode(saved_tokenizer.encode(text)) == text


def test_chat_template_renders_tool_call_and_result(saved_tokenizer, tmp_path):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 20}'},
    ]

    rendered = saved_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    assert (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    ) in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_chat_template_plain_conversation_and_string_arguments(saved_tokenizer):
    plain = saved_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert plain == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"

    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    rendered = saved_tokenizer.apply_chat_template(
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]}], tokenize=False
    )
    assert '{"name": "f", "arguments": {"a": 1}}' in rendered


def test_chat_template_is_stored_with_the_tokenizer(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen2", num_layers=1)
    stored = (checkpoint / "chat_template.jinja").read_text()
    assert stored.strip() == tiny_checkpoint.CHAT_TEMPLATE.strip()


def test_unknown_arch_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown arch"):
        make_tiny_checkpoint(tmp_path, "gpt2")


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": "int8"}, {"num_heads": 4, "num_kv_heads": 3}, {"arch": "qwen2", "head_dim": 32}],
)
def test_invalid_shapes_are_config_errors(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        make_tiny_checkpoint(tmp_path, **{"arch": "llama", **kwargs})


def test_get_shape_unknown_lists_known_names():
    with pytest.raises(ConfigError, match="qwen3-4b"):
        get_shape("gpt-5")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_use_transformers_config_keys(name):
    shape = get_shape(name)
    config = AutoConfig.for_model(**shape).to_dict()
    for key, value in shape.items():
        assert key in config, key
        assert config[key] == value, key


def test_get_shape_returns_a_copy():
    get_shape("qwen3-4b")["rope_parameters"]["rope_theta"] = 1.0
    assert SHAPES["qwen3-4b"]["rope_parameters"]["rope_theta"] == 1000000.0


def test_key_real_shapes():
    assert get_shape("llama-3.1-8b")["rope_parameters"]["factor"] == 8.0
    assert get_shape("qwen3-4b")["tie_word_embeddings"] is True
    moe = get_shape("qwen3-30b-a3b")
    assert (moe["num_local_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (128, 8, 768)
    assert get_shape("qwen2.5-7b")["vocab_size"] == 152064


def test_random_model_dir_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path))

    first = random_model_dir()
    marker = first / "config.json"
    built_at = marker.stat().st_mtime_ns
    second = random_model_dir()

    assert second == first
    assert marker.stat().st_mtime_ns == built_at
    assert first.parent == tmp_path / "models"
    assert [p.name for p in first.parent.iterdir()] == [first.name]
    config = AutoConfig.from_pretrained(first)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.head_dim) == ("qwen3", 128, 4, 32)


def test_cache_tolerates_a_concurrent_builder(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path))
    real_make = tiny_checkpoint.make_tiny_checkpoint
    winner = tmp_path / "models" / f"race-{tiny_checkpoint._args_digest({'arch': 'llama', 'num_layers': 1})}"

    def make_while_another_worker_finishes(out_dir, **kwargs):
        real_make(winner, **kwargs)
        return real_make(out_dir, **kwargs)

    monkeypatch.setattr(tiny_checkpoint, "make_tiny_checkpoint", make_while_another_worker_finishes)
    result = tiny_checkpoint.cached_checkpoint_dir("race", arch="llama", num_layers=1)

    assert result == winner
    assert [p.name for p in winner.parent.iterdir()] == [winner.name]


def test_cli_prints_the_checkpoint_path(tmp_path, capsys):
    tiny_checkpoint.main(["--arch", "qwen3_moe", "--out", str(tmp_path / "cli"), "--num-layers", "1", "--seed", "3"])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(printed) == tmp_path / "cli"
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model_type"] == "qwen3_moe"
