"""Palu-style low-rank KV (``policies/palu.py``) against references from its definition.

* the per-head bases span the leading eigenspace of ``W W^T`` (an independent eigendecomposition);
* on KV produced by a projection, the reconstruction error equals the part of the pre-RoPE vector outside
  the basis (norms: RoPE is a rotation), and is exact at full rank;
* through the engine: on checkpoints whose key / value projections have rank <= r (rewritten with
  transformers), rank r reproduces dense decoding token for token (llama3 RoPE scaling, qwen2's projection
  bias, qwen3's key norm); at full rank on any checkpoint too; SnapKV + Palu equals SnapKV;
* bytes per token are exact, and bad knobs are ConfigErrors.
"""

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.registry import create_kv_storage
from policies.palu import LowRank, _RotaryTables, head_bases

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)


def _prompts(vocab: int = 500):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 61, 18)]


def _llm(model_dir, **kw):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=32, **kw)


def test_bases_span_the_leading_eigenspace():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 16, 40, generator=g)
    basis = head_bases(w, 6)
    for h in range(3):
        _, vecs = torch.linalg.eigh((w[h] @ w[h].T).double())
        top = vecs[:, -6:]
        torch.testing.assert_close((basis[h] @ basis[h].T).double(), top @ top.T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(basis[h].T @ basis[h], torch.eye(6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rank", [6, 16])
def test_reconstruction_error_is_the_part_outside_the_basis(rank, tiny_dirs):
    llm = _llm(tiny_dirs["qwen2"])  # biased projections
    model = llm.engine.model
    proj = model.kv_projections()[0]
    rotary = _RotaryTables(model.rotary)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(50, proj["k"].shape[-1], generator=g)
    positions = torch.randint(0, 900, (50,), generator=g)
    for keys, w, b in ((True, proj["k"], proj["k_bias"]), (False, proj["v"], proj["v_bias"])):
        x = torch.einsum("hdi,ni->nhd", w, h) + b  # [N, H, D] the projection's outputs
        cached = rotary.rotate(x, positions) if keys else x
        codec = LowRank(rank, torch.float32, keys, head_bases(w, rank), b, rotary if keys else None)
        fields = codec.encode(cached, positions) if keys else codec.encode(cached)
        back = codec.decode(fields, x.shape[-1])
        basis = head_bases(w, rank)
        outside = (x - b) - torch.einsum("nhr,hdr->nhd", torch.einsum("nhd,hdr->nhr", x - b, basis), basis)
        torch.testing.assert_close((back - cached).norm(dim=-1), outside.norm(dim=-1), atol=1e-4, rtol=1e-4)
        if rank == x.shape[-1]:
            torch.testing.assert_close(back, cached, atol=1e-4, rtol=1e-4)


def _low_rank_checkpoint(src, dst, rank: int):
    """``src`` with each key / value head's projection truncated to its best rank-``rank`` approximation."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(-1, d, proj.weight.shape[1]).double()
                u, s, vh = torch.linalg.svd(w, full_matrices=False)
                s[:, rank:] = 0
                proj.weight.copy_((u @ torch.diag_embed(s) @ vh).reshape(proj.weight.shape).float())
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rank_r_projections_decode_exactly_like_dense(arch, tiny_dirs, tmp_path):
    head_dim = 32 if arch == "qwen3" else 16
    rank = head_dim // 4
    model_dir = _low_rank_checkpoint(tiny_dirs[arch], tmp_path / arch, rank)
    dense = _llm(model_dir).generate(_prompts(), PARAMS)
    palu = _llm(model_dir, kv_storage="palu",
                kv_storage_config={"rank_ratio": rank / head_dim, "latent_dtype": "float32"})
    assert palu.engine.codec.rank(head_dim) == rank
    got = palu.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in dense]
    for a, b in zip(got, dense):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


def test_full_rank_is_lossless_and_composes_with_eviction(tiny_dirs):
    ps = _prompts()
    full = {"rank_ratio": 1.0, "latent_dtype": "float32"}
    assert [o.token_ids for o in _llm(tiny_dirs["llama"], kv_storage="palu", kv_storage_config=full).generate(
        ps, PARAMS)] == [o.token_ids for o in _llm(tiny_dirs["llama"]).generate(ps, PARAMS)]
    snap = {"method": "snapkv", "method_config": {"budget": 24, "window": 8}}
    alone = _llm(tiny_dirs["llama"], **snap).generate(ps, PARAMS)
    both = _llm(tiny_dirs["llama"], kv_storage="palu", kv_storage_config=full, **snap)
    assert [o.token_ids for o in both.generate(ps, PARAMS)] == [o.token_ids for o in alone]


def test_bytes_per_token():
    from engine.contract.codec import CodedCacheSpec

    codec = create_kv_storage("palu", {"rank_ratio": 0.5})
    spec = CodedCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                          device=torch.device("cpu"), page_size=16, codec=codec)
    codec.check(spec)
    # keys: 64 fp16 + an int32 position; values: 64 fp16 -- per KV head and layer, against 2 x 128 x 2 bytes
    assert spec.bytes_per_token == 32 * 8 * (64 * 2 + 4 + 64 * 2)


@pytest.mark.parametrize("options", [{"rank_ratio": 0}, {"rank_ratio": 1.5}, {"rank_ratio": "half"},
                                     {"latent_dtype": "int8"}, {"rank": 4}])
def test_bad_knobs_are_config_errors(options):
    with pytest.raises(ConfigError):
        create_kv_storage("palu", options)
