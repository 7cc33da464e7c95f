"""The Triton backend on a latent (MLA) cache against the torch reference backend: one KV head whose values are
a view of its rows' first channels, decode rows through the MLA decode kernel (with scores, and selected-slot
views read as a page-size-1 table), prefill chunks and mixed steps. Runs compiled on a GPU, or in Triton's CPU
interpreter (TRITON_INTERPRET=1) at tiny sizes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.attention_backend import TorchReferenceBackend  # noqa: E402
from engine.contract.view import SelectedSlotsView  # noqa: E402
from engine.gpu_backends import TritonBackend  # noqa: E402
from tests.latent_views import latent_view as latent_rows_view  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DK, DV, HQ, PAGE = 48, 32, 16, 16


def latent_view(kv_lens, query_lens, seed=0):
    return latent_rows_view(kv_lens, query_lens, page=PAGE, width=DK, heads=HQ, device=DEVICE, seed=seed)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1]])
def test_latent_decode_and_mixed_steps_equal_the_torch_backend(query_lens):
    q, latent, view = latent_view([1, 40, 75], query_lens)
    ref, _ = TorchReferenceBackend().forward(q, latent, latent[..., :DV], view, DK**-0.5)
    got, _ = TritonBackend().forward(q, latent, latent[..., :DV], view, DK**-0.5)
    assert got.shape == (sum(query_lens), HQ, DV)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_latent_decode_scores_and_selected_slots_equal_the_torch_backend():
    q, latent, view = latent_view([20, 75], [1, 1], seed=1)
    backend, ref_backend = TritonBackend(), TorchReferenceBackend()
    got, probs = backend.forward(q, latent, latent[..., :DV], view, DK**-0.5, return_scores=True)
    ref, ref_probs = ref_backend.forward(q, latent, latent[..., :DV], view, DK**-0.5, return_scores=True)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    for p, r in zip(probs, ref_probs):
        torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-5)
    flat = [(view.block_tables[i, s // PAGE] * PAGE + s % PAGE).item() for i, s in ((0, 3), (0, 7), (0, 19))]
    flat += [(view.block_tables[1, s // PAGE] * PAGE + s % PAGE).item() for s in (0, 33, 50, 74)]
    selected = SelectedSlotsView(
        block_tables=view.block_tables, kv_lens=torch.tensor([3, 4], dtype=torch.int32, device=DEVICE),
        query_start_loc=view.query_start_loc, page_size=PAGE, kv_lens_cpu=[3, 4], query_lens_cpu=[1, 1],
        slot_indptr=torch.tensor([0, 3, 7], device=DEVICE), slot_indices=torch.tensor(flat, device=DEVICE))
    got, _ = backend.forward(q, latent, latent[..., :DV], selected, DK**-0.5)
    ref, _ = ref_backend.forward(q, latent, latent[..., :DV], selected, DK**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_a_latent_width_its_kernels_do_not_tile_is_refused_naming_the_field():
    from engine.contract.method import SparseMethod

    backend = TritonBackend()
    assert backend.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=576, value_dim=512) == []
    (reason,) = backend.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=1024 + 64, value_dim=1024)
    assert "kv_lora_rank <= 512" in reason and "this model: kv_lora_rank 1024" in reason
    (reason,) = backend.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=512 + 128, value_dim=512)
    assert "qk_rope_head_dim 128" in reason
    assert TorchReferenceBackend().unsupported(SparseMethod(), torch.bfloat16, None, 1024 + 64, 1024) == []


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_an_engine_on_e4m3_latent_rows_gives_the_torch_backends_tokens(arch, mla_dirs):
    """``kv_storage="fp8"`` on an MLA model with the Triton backend: decode steps read the codes in the MLA
    decode kernel, prompt chunks and mixed steps the decoded pages in the MLA prefill kernel; greedy tokens and
    logprobs equal the torch backend's, which decodes the same codes (prompts prefilled in chunks beside
    decoding requests)."""
    from engine import LLM, SamplingParams

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 41, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    outs = []
    for triton_backend in (False, True):
        llm = LLM(mla_dirs[arch], device=str(DEVICE), dtype="float32", attention_backend="torch", kv_storage="fp8",
                  max_num_batched_tokens=32, enforce_eager=True, num_pages=128, page_size=8)
        engine = llm.engine
        if triton_backend:
            engine.backend = engine.runner.backend = TritonBackend()
        outs.append(llm.generate(prompts, params))
        assert type(engine.cache.storage).__name__ == "CodedLatentKV"
    for ref, got in zip(*outs):
        assert got.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-4
