"""flashinfer's MLA wrapper behind the flashinfer backend on a latent cache (one KV head of kv_lora_rank + rope
channels, values its first kv_lora_rank) against the torch reference backend: decode rows, prompt chunks and
mixed steps, bf16, page sizes 16 and 64. GPU and flashinfer only; the refusal of other latent sizes runs anywhere
flashinfer imports."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("flashinfer's MLA kernels need a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from engine.attention_backend import TorchReferenceBackend  # noqa: E402
from engine.contract.method import SparseMethod  # noqa: E402
from engine.gpu_backends import FlashInferBackend  # noqa: E402
from tests.latent_views import latent_view as latent_rows_view  # noqa: E402

CUDA = torch.device("cuda")
RANK, ROPE, HQ = 512, 64, 16  # DeepSeek's latent sizes; GLM-4.7-Flash has 20 query heads, V3 128


def latent_view(kv_lens, query_lens, page, seed=0):
    return latent_rows_view(kv_lens, query_lens, page=page, width=RANK + ROPE, heads=HQ, device=CUDA,
                            dtype=torch.bfloat16, scale=0.5, seed=seed)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("kv_lens,query_lens", [
    ([1, 40, 300], [1, 1, 1]),  # decode rows
    ([37, 130], [37, 70]),  # a whole prompt and a chunk after cached context
    ([200, 5, 64], [1, 5, 1]),  # a mixed step
])
def test_flashinfer_mla_equals_the_torch_backend(page, kv_lens, query_lens):
    q, latent, view = latent_view(kv_lens, query_lens, page)
    scale = (128 + ROPE) ** -0.5
    ref, _ = TorchReferenceBackend().forward(q.float(), latent.float(), latent[..., :RANK].float(), view, scale)
    got, _ = FlashInferBackend(CUDA).forward(q, latent, latent[..., :RANK], view, scale)
    assert got.shape == (sum(query_lens), HQ, RANK) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_latent_sizes_its_wrapper_does_not_run_are_refused_naming_them():
    backend = FlashInferBackend(CUDA)
    assert backend.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=RANK + ROPE, value_dim=RANK) == []
    (reason,) = backend.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=256 + 32, value_dim=256)
    assert "kv_lora_rank 512 with qk_rope_head_dim 64 only" in reason and "kv_lora_rank 256" in reason
