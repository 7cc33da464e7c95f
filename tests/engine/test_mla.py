"""Multi-head latent attention models (DeepSeek-V3, GLM-4.7-Flash) against transformers, and their latent KV.

The engine-level greedy parity (chunked prefill, prefix hits, preemption) is in test_engine_vs_hf; here: the
forward's logits against HF's on the same random checkpoints, the latent storage's exact layout, the
configurations the code refuses, the multi-token-prediction layer skipped at load, and tensor parallel (latent rows
under a KV codec: test_mla_fp8)."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.errors import CheckpointError, ConfigError
from engine.loader import load_model
from engine.model_config import ModelConfig
from tests.hf_reference import hf_model
from tests.engine.test_models_vs_hf import DenseCausalRunner

ARCHS = ["deepseek_v3", "glm4_moe_lite"]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_logits_equal_transformers(arch, mla_dirs):
    model_dir = mla_dirs[arch]
    model, config = load_model(model_dir, dtype=torch.float32)
    ids = torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(str(model_dir))(ids[None]).logits[0]
        ours = model.compute_logits(model(ids, torch.arange(40), DenseCausalRunner()))
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert config.num_kv_heads == 1 and config.head_dim == 32 + 8 and config.value_dim == 32


def test_config_reads_the_deepseek_fields(mla_dirs):
    ds = ModelConfig.from_dir(mla_dirs["deepseek_v3"])
    assert ds.mla.q_lora_rank is None and not ds.mla.rope_interleave
    mscale = 0.1 * 1.0 * torch.tensor(4.0).log().item() + 1.0  # YaRN factor 4, mscale_all_dim 1
    assert ds.mla.softmax_scale == pytest.approx((16 + 8) ** -0.5 * mscale**2)
    assert (ds.expert_groups, ds.topk_groups, ds.mlp_only_layers, ds.routed_scaling_factor) == (4, 2, (0,), 2.5)
    assert ds.shared_expert_intermediate_size == 32 and ds.expert_scoring == "sigmoid"
    glm = ModelConfig.from_dir(mla_dirs["glm4_moe_lite"])
    assert glm.mla.q_lora_rank == 48 and glm.mla.rope_interleave and glm.mlp_only_layers == (0,)
    assert glm.routed_scaling_factor == 1.8


@pytest.mark.parametrize("arch", ARCHS)
def test_latent_pool_holds_one_row_per_token_and_values_are_its_prefix(arch, mla_dirs):
    llm = LLM(mla_dirs[arch], dtype="float32", device="cpu", page_size=16, num_pages=64)
    storage = llm.engine.cache.storage
    # asserted from the storage: [layers, pages (+ scratch), page_size, one row, kv_lora_rank + rope]
    assert tuple(storage.rows.shape) == (2, 65, 16, 1, 32 + 8)
    assert storage.rows.numel() * 4 == llm.engine.cache.spec.bytes_per_page * 65
    keys, values = storage.layer_kv(1)
    assert values.shape[-1] == 32 and values.data_ptr() == keys.data_ptr()  # a view: nothing stored twice
    llm.generate([list(range(5, 45))], SamplingParams(temperature=0.0, max_tokens=3))
    assert torch.equal(values.flatten(0, 1)[:40], keys.flatten(0, 1)[:40, :, :32])


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope_type 'dynamic'"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(topk_method="greedy"), "topk_method 'greedy'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config (fp8)"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be positive"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(n_group=3), "n_group 3 must divide n_routed_experts 8"),
    (dict(mlp_layer_types=["dense"]), "mlp_layer_types"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2"),
])
def test_unsupported_variants_are_refused_at_load_naming_the_field(mla_dirs, tmp_path, changes, field):
    model_dir = _edit_config(mla_dirs["deepseek_v3"], tmp_path / "edited", **changes)
    with pytest.raises((CheckpointError, ConfigError)) as exc:
        load_model(model_dir, dtype=torch.float32)
    assert field in str(exc.value)


def test_a_multi_token_prediction_layer_is_skipped_with_a_log_line(mla_dirs, tmp_path, caplog):
    model_dir = _edit_config(mla_dirs["glm4_moe_lite"], tmp_path / "mtp")
    weights = load_file(model_dir / "model.safetensors")
    weights |= {k.replace("layers.1.", "layers.2."): v.clone() for k, v in weights.items() if ".layers.1." in k}
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, model_dir / "model.safetensors")
    reference, _ = load_model(mla_dirs["glm4_moe_lite"], dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="engine.models.deepseek_v3"):
        model, _ = load_model(model_dir, dtype=torch.float32)
    assert [r.message for r in caplog.records].count(
        "skipping checkpoint layer 2 and beyond (multi-token prediction, not run)") == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("arch,method,config", [
    ("deepseek_v3", "dense", {}),
    ("glm4_moe_lite", "snapkv", {"budget": 12, "window": 4}),
    ("deepseek_v3", "h2o", {"heavy_budget": 6, "recent_budget": 6}),
    ("glm4_moe_lite", "rkv", {"budget": 12, "buffer": 6, "alpha": 3, "kernel_size": 3}),
    ("deepseek_v3", "kvzip", {"budget": 12, "window": 4, "chunk_size": 16}),
])
def test_tensor_parallel_splits_the_heads_and_replicates_the_latent(tiny_dirs, arch, method, config):
    """Two gloo ranks, two query heads each (q_b_proj / kv_b_proj columns, o_proj rows), the latent row whole on
    both: tokens equal the single rank's, and a method keeps the same latent slots on rank 0 (its scores pooled
    over the query heads of both ranks: ``reduce_over_query_heads``)."""
    from tests.engine.test_tensor_parallel import (PROMPTS, assert_gone, assert_same_greedy, engine, generate,
                                            kept_positions, worker_procs)

    options = dict(method=method, method_config=config)
    ref, ref_kept = generate(engine(tiny_dirs[arch], 1, **options), PROMPTS, kept_positions)
    with engine(tiny_dirs[arch], 2, **options) as eng:
        procs = worker_procs(eng)
        assert eng.cache.spec.num_kv_heads == 1 and eng.model.model.layers[0].self_attn.num_heads == 2
        got, kept = generate(eng, PROMPTS, kept_positions)
    assert_gone(procs)
    assert_same_greedy(ref, got)
    for ref_layers, layers in zip(ref_kept, kept):
        assert all(torch.equal(g, r) for r, g in zip(ref_layers, layers))
    if method == "snapkv":
        assert ref_kept[2][0].shape == (1, 12)  # the 41-token prompt was cut to the budget


def test_rows_stored_by_the_input_kernels_route_equal_the_writes(mla_dirs, monkeypatch):
    """Where the storage hands out its rows (``LatentKV.row_target``, a GPU's route, forced here on the CPU: the
    reference op then stores them), the runner stores each layer's rows at that layer's slots: a prompt in chunks
    and a PyramidKV chain's turns (per-layer slots after its compaction) leave the same pool and tokens as the
    storage's own ``write``."""
    import random

    from engine.storage.latent import LatentKV
    from tests.chain_helpers import random_tokens, run_chain_turn

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    method = {"budget": 24, "window": 6, "kernel_size": 3, "beta": 4}

    def run(forced: bool):
        if forced:
            monkeypatch.setattr(LatentKV, "row_target",
                                lambda self, layer: self.rows[layer].view(-1, self.spec.head_dim))
        llm = LLM(mla_dirs["glm4_moe_lite"], dtype="float32", device="cpu", page_size=4, num_pages=96,
                  max_num_batched_tokens=16, method="pyramidkv", method_config=method)
        engine, rng = llm.engine, random.Random(3)
        history, outputs, per_layer = [], [], []
        for n in (40, 12, 3):
            history += random_tokens(rng, n)
            outputs.append(run_chain_turn(engine, "c", list(history), params).token_ids)
            history += outputs[-1]
            per_layer.append(engine.chains.index.get("c").table.layer_lens is not None)
        rows = engine.cache.storage.rows.clone()
        monkeypatch.undo()
        return outputs, rows, per_layer

    plain, forced = run(False), run(True)
    assert forced[2][-1]  # the chain's layers hold different lengths: per-layer slots were taken
    assert forced[0] == plain[0]
    assert torch.equal(forced[1], plain[1])
