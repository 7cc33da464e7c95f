"""benchmarks.mla_prefill's two prefill paths (absorbed: the engine's; expanded: K / V per head) compute the same
attention: each against the definition in fp32 at tiny sizes, K / V head sizes equal (the paged prefill kernel)
and not (SDPA). Without a GPU the kernels run in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks import mla_prefill as bench  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("shape", [bench.TINY, (4, 32, 16, 24, 24)], ids=["kv-equal", "v-narrower"])
@pytest.mark.parametrize("chunk,context", [(8, 40), (40, 40)])
def test_both_paths_equal_the_definition(shape, chunk, context):
    inputs = bench.make_inputs(shape, chunk, context, DEVICE, dtype=torch.float32, seed=chunk)
    want = bench.reference(**inputs)
    for path in (bench.absorbed, bench.expanded, bench.engine_expanded):
        got = path(**inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
