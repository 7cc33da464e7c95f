"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, the gated delta rule
reference ops, and the configurations refused at load.

The models run through ``StepRunner``, a LayerRunner keeping per sequence a KV cache for the full-attention
layers and the conv / recurrent states of the linear ones between steps (``linear_state``, as the engine's), so a
sequence fed in several steps (chunked prefill, then decode) must give the logits of one pass."""

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from agentrt_kernels.torch_ref.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from engine.errors import CheckpointError
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.tiny_checkpoint import make_tiny_checkpoint

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
EXPECTED = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM"}
LAYERS = {  # each a different layer pattern; every one has linear layers on both sides of a full-attention one
    "qwen3_5": ("linear_attention", "full_attention", "linear_attention", "full_attention"),
    "qwen3_5_moe": ("linear_attention", "linear_attention", "full_attention", "linear_attention"),
    "qwen3_next": ("linear_attention", "full_attention", "linear_attention", "full_attention"),
}
SEQ_LEN = 40


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    common = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=512,
                  max_position_embeddings=512, initializer_range=0.1, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32)
    return {
        "qwen3_5": make_tiny_checkpoint(root / "qwen3_5", "qwen3_5", seed=11, **common),  # 4 layers, interval 2
        "qwen3_5_moe": make_tiny_checkpoint(root / "qwen3_5_moe", "qwen3_5_moe", seed=12, **common,
                                            layer_types=list(LAYERS["qwen3_5_moe"]), linear_num_key_heads=4,
                                            linear_value_head_dim=8),
        "qwen3_next": make_tiny_checkpoint(root / "qwen3_next", "qwen3_next", seed=13, **common, head_dim=32,
                                           partial_rotary_factor=0.5, linear_key_head_dim=8),
    }


@pytest.fixture(scope="module")
def models(hybrid_dirs):
    return {arch: load_model(d, dtype=torch.float32) for arch, d in hybrid_dirs.items()}


_HF = {}


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    key = str(model_dir)
    if key not in _HF:
        _HF[key] = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[key](ids[None]).logits[0]


def input_ids(seed: int, n: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err < rel * scale, f"max abs error {err} vs {rel} * {scale}"


class _State:
    """The engine's LinearState over buffers holding this step's sequences' states at slots 0, 1, ... (the layer
    updates them in place); ``sync`` hands them back to the runner."""

    def __init__(self, runner, layer, seqs, lens):
        self.runner, self.layer, self.seqs, self.query_lens = runner, layer, seqs, lens
        states = [runner.states.get((seq, layer)) or runner.zero_state() for seq in seqs]
        self.conv_buffer = torch.stack([c for c, _ in states])
        self.recurrent_buffer = torch.stack([r for _, r in states])
        self.slots = torch.arange(len(seqs))

    def sync(self):
        for i, seq in enumerate(self.seqs):
            self.runner.states[(seq, self.layer)] = (self.conv_buffer[i].clone(), self.recurrent_buffer[i].clone())
        self.runner.stored.append(self.layer)


class StepRunner:
    """Steps over several sequences: per sequence and full-attention layer its keys / values so far, per sequence
    and linear layer its states. ``step(seqs, lens)`` sets the sequences of the next forward, in order."""

    wants_layer_output = True

    def __init__(self, config: ModelConfig, dtype=torch.float32):
        self.config, self.dtype = config, dtype
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def zero_state(self):
        lin = self.config.linear
        return torch.zeros(lin.conv_state_shape, dtype=self.dtype), torch.zeros(lin.recurrent_state_shape)

    def step(self, seqs: list[int], lens: list[int]) -> None:
        self.seqs, self.lens, self.ended, self.stored, self.open = seqs, lens, [], [], []

    def linear_state(self, layer: int) -> _State:
        state = _State(self, layer, self.seqs, self.lens)
        self.open.append(state)
        return state

    def attention(self, layer, q, k, v):
        out, start = [], 0
        for seq, n in zip(self.seqs, self.lens):
            keys, values = self.kv.get((seq, layer), (k[:0], v[:0]))
            keys, values = torch.cat([keys, k[start:start + n]]), torch.cat([values, v[start:start + n]])
            self.kv[(seq, layer)] = keys, values
            past = keys.shape[0] - n
            group = q.shape[1] // keys.shape[1]
            kk, vv = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n], kk) * q.shape[-1] ** -0.5
            visible = torch.arange(keys.shape[0])[None, :] <= (past + torch.arange(n))[:, None]
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32)
            out.append(torch.einsum("hqk,khd->qhd", probs.to(q.dtype), vv))
            start += n
        return torch.cat(out)

    def end_layer(self, layer, hidden):
        self.ended.append(layer)


def run_step(model, runner: StepRunner, chunks: list[torch.Tensor], offsets: list[int], seqs: list[int]):
    """One forward over ``chunks`` (one per sequence, starting at position ``offsets``) -> logits per chunk."""
    runner.step(seqs, [len(c) for c in chunks])
    positions = torch.cat([torch.arange(o, o + len(c)) for c, o in zip(chunks, offsets)])
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(chunks), positions, runner))
    for state in runner.open:
        state.sync()
    config = model.config
    assert runner.ended == list(range(config.kv_layers))  # end_layer: full-attention ordinals only
    assert runner.stored == list(range(config.linear_layers))
    return logits.split(runner.lens)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_pass_equals_transformers(arch, hybrid_dirs, models):
    model, config = models[arch]
    assert config.architecture == EXPECTED[arch] and config.linear.layer_types == LAYERS[arch]
    ids = input_ids(1)
    (ours,) = run_step(model, StepRunner(config), [ids], [0], [0])
    assert_close(ours, hf_logits(hybrid_dirs[arch], ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_steps_continue_the_states(arch, hybrid_dirs, models):
    """17 + 1 + 9 + 13 tokens in four steps (the 1-token step takes the recurrent form) equal HF's one pass."""
    model, config = models[arch]
    ids = input_ids(2)
    ref = hf_logits(hybrid_dirs[arch], ids)
    runner, start = StepRunner(config), 0
    for n in (17, 1, 9, 13):
        (ours,) = run_step(model, runner, [ids[start:start + n]], [start], [0])
        assert_close(ours, ref[start:start + n])
        start += n


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_equals_each_sequence_alone(arch, hybrid_dirs, models):
    """Two sequences share steps: prefill [5, 9], then both decode (one batched recurrent step), then [3, 1] (a
    mixed step: one segment, one decode row), then both decode again from the states the mixed step left."""
    model, config = models[arch]
    a, b = input_ids(3, 10), input_ids(4, 12)
    alone = {0: hf_logits(hybrid_dirs[arch], a), 1: hf_logits(hybrid_dirs[arch], b)}
    runner, done = StepRunner(config), {0: 0, 1: 0}
    for lens in ([5, 9], [1, 1], [3, 1], [1, 1]):
        chunks = [seq[done[i]:done[i] + n] for i, (seq, n) in enumerate(zip((a, b), lens))]
        logits = run_step(model, runner, chunks, [done[0], done[1]], [0, 1])
        for i, n in enumerate(lens):
            assert_close(logits[i], alone[i][done[i]:done[i] + n])
            done[i] += n
    # and against our own single-sequence pass, closer than the HF tolerance
    (ours_a,) = run_step(model, StepRunner(config), [a], [0], [0])
    (ours_b,) = run_step(model, StepRunner(config), [b], [0], [0])
    assert_close(ours_a, alone[0])
    assert_close(ours_b, alone[1])


def test_bf16_forward_follows_transformers(hybrid_dirs):
    """bf16 weights, a bf16 conv state, an fp32 recurrent state, in two steps: as far from the fp32 logits as
    transformers' own bf16 forward is (the 0.1-initialized checkpoint amplifies bf16 rounding: the DeltaNet and
    MLP layers match HF's bf16 bit for bit, attention kernels round differently)."""
    model, config = load_model(hybrid_dirs["qwen3_next"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = input_ids(5, 24)
    runner = StepRunner(config, dtype=torch.bfloat16)
    ours = torch.cat([run_step(model, runner, [ids[:16]], [0], [0])[0],
                      run_step(model, runner, [ids[16:]], [16], [0])[0]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hybrid_dirs["qwen3_next"]), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_bf16 = hf(ids[None]).logits[0].float()
    fp32 = hf_logits(hybrid_dirs["qwen3_next"], ids)
    assert (ours - fp32).abs().max() <= 1.5 * (hf_bf16 - fp32).abs().max()


def test_config_reads_the_hybrid_fields(hybrid_dirs):
    config = ModelConfig.from_dir(hybrid_dirs["qwen3_next"])
    lin = config.linear
    assert (config.kv_layers, config.linear_layers, config.num_layers) == (2, 2, 4)
    assert (config.head_dim, config.partial_rotary_factor, config.rotary_dim) == (32, 0.5, 16)
    assert config.qk_norm and not config.attention_bias and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == 32 and config.num_experts == 4
    assert lin.conv_state_shape == (2 * 2 * 8 + 4 * 16, 3) and lin.recurrent_state_shape == (4, 8, 16)
    assert [lin.kind_index(i) for i in range(4)] == [0, 0, 1, 1] and lin.recurrent_dtype == "float32"
    assert config.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 32 * 4  # the full-attention layers only
    raw = json.loads((hybrid_dirs["qwen3_5"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and "mrope_section" not in raw["rope_parameters"]
    # no layer_types: every full_attention_interval-th layer; mrope keys and a nested text config are read too
    del raw["layer_types"]
    raw["rope_parameters"] |= {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": True, "vision_config": {"depth": 1},
              "text_config": {**raw, "full_attention_interval": 3, "architectures": None, "tie_word_embeddings": False}}
    config = ModelConfig.from_hf_dict(nested)
    assert config.linear.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    assert config.tie_word_embeddings and config.rope_scaling is None and config.rotary_dim == 4
    assert config.architecture == "Qwen3_5ForConditionalGeneration" and config.num_experts == 0


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes,message", [
    (dict(layer_types=["linear_attention", "full_attention", "linear_attention", "sliding_attention"]),
     "layer_types[3] 'sliding_attention' is not supported"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types names 2 layers, num_hidden_layers is 4"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
])
def test_unsupported_variants_are_refused_naming_them(hybrid_dirs, tmp_path, changes, message):
    model_dir = _edit(hybrid_dirs["qwen3_5"], tmp_path / "edited", **changes)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(model_dir, dtype=torch.float32)


def test_vision_language_checkpoint_runs_its_text_model(hybrid_dirs, tmp_path, caplog):
    """A Qwen3_5ForConditionalGeneration checkpoint from transformers (a tiny vision tower included): its text
    model's logits on text-only input, the ``model.language_model.*`` keys mapped, the vision tower skipped with
    one log line."""
    text = transformers.AutoConfig.from_pretrained(hybrid_dirs["qwen3_5"]).to_dict()
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                             out_hidden_size=64, patch_size=4, num_position_embeddings=16),
        architectures=["Qwen3_5ForConditionalGeneration"])
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    with caplog.at_level(logging.INFO, logger="engine.models.gated_deltanet"):
        model, mc = load_model(tmp_path, dtype=torch.float32)
    assert [r.message for r in caplog.records].count(
        "skipping checkpoint tensors model.visual.* (the vision tower, not run)") == 1
    assert mc.architecture == "Qwen3_5ForConditionalGeneration" and mc.linear_layers == 2
    ids = input_ids(6, 20)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    (ours,) = run_step(model, StepRunner(mc), [ids], [0], [0])
    assert_close(ours, ref)


def test_moe_vision_language_layout_loads_the_same_weights(hybrid_dirs, tmp_path):
    """Qwen3_5MoeForConditionalGeneration: config under ``text_config``, weights under ``model.language_model.``
    plus vision and multi-token-prediction tensors to skip: the same model as the text checkpoint."""
    src = hybrid_dirs["qwen3_5_moe"]
    shutil.copytree(src, tmp_path / "vl")
    text = json.loads((src / "config.json").read_text())
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": {**text, "architectures": None}}
    (tmp_path / "vl" / "config.json").write_text(json.dumps(nested))
    weights = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    weights |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    save_file(weights, tmp_path / "vl" / "model.safetensors")
    reference, _ = load_model(src, dtype=torch.float32)
    model, config = load_model(tmp_path / "vl", dtype=torch.float32)
    assert config.architecture == "Qwen3_5MoeForConditionalGeneration" and config.num_experts == 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_a_missing_deltanet_projection_is_named(hybrid_dirs, tmp_path):
    model_dir = _edit(hybrid_dirs["qwen3_next"], tmp_path / "missing")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.2.linear_attn.in_proj_ba.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.linear_attn\.in_proj_ba\.weight"):
        load_model(model_dir, dtype=torch.float32)


# --- the reference ops


def _delta_inputs(length, k_heads=2, v_heads=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, k_heads, dk, generator=gen), torch.randn(length, k_heads, dk, generator=gen)
    v = torch.randn(length, v_heads, dv, generator=gen)
    g = -torch.rand(length, v_heads, generator=gen) * 0.5
    beta = torch.rand(length, v_heads, generator=gen)
    state = torch.randn(v_heads, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("length", [1, 37, 100])
def test_chunked_rule_equals_the_recurrent_one(chunk_size, length):
    q, k, v, g, beta, state = _delta_inputs(length)
    for initial in (None, state):
        out_c, final_c = chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=chunk_size)
        out_r, final_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
        torch.testing.assert_close(out_c, out_r, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final_c, final_r, atol=2e-5, rtol=1e-4)
        assert final_c.dtype == torch.float32 and out_c.shape == (length, 4, 6)


@pytest.mark.parametrize("split", [1, 15, 16, 17, 63, 64, 65, 99])
def test_a_split_sequence_continues_from_its_state(split):
    q, k, v, g, beta, state = _delta_inputs(100, seed=1)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    first, mid = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split], state, chunk_size=16)
    rule = recurrent_gated_delta_rule if 100 - split == 1 else chunk_gated_delta_rule
    second, end = rule(q[split:], k[split:], v[split:], g[split:], beta[split:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(end, final, atol=2e-5, rtol=1e-4)

    gen = torch.Generator().manual_seed(split)
    x, weight = torch.randn(100, 12, generator=gen), torch.randn(12, 4, generator=gen)
    conv_whole, conv_state = causal_conv1d(x, weight)
    a, mid_state = causal_conv1d(x[:split], weight)
    b, end_state = causal_conv1d(x[split:], weight, mid_state)
    torch.testing.assert_close(torch.cat([a, b]), conv_whole, atol=1e-6, rtol=1e-6)
    assert torch.equal(end_state, conv_state) and torch.equal(mid_state[:, -1], x[split - 1])
    step, step_state = causal_conv1d_step(x[split:split + 1].expand(2, 12), weight, mid_state.expand(2, 12, 3))
    torch.testing.assert_close(step[1], conv_whole[split], atol=1e-6, rtol=1e-6)
    assert torch.equal(step_state[0], causal_conv1d(x[:split + 1], weight)[1])


def test_reference_ops_equal_transformers_fallbacks():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = _delta_inputs(45, seed=2)
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=16,
                                                     initial_state=state[None], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, ref[0]) and torch.equal(ours_state, ref_state[0])
    ours, ours_state = recurrent_gated_delta_rule(q[:3], k[:3], v[:3], g[:3], beta[:3], state)
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q[None, :3], k[None, :3], v[None, :3], g[None, :3],
                                                         beta[None, :3], initial_state=state[None],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, ref[0]) and torch.equal(ours_state, ref_state[0])
    x, weight = torch.randn(30, 12), torch.randn(12, 4)
    conv = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(causal_conv1d(x, weight)[0], conv, atol=1e-6, rtol=0)
