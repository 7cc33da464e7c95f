"""agentrt_kernels.triton.route_topk (fused MoE router softmax + top-k) vs the torch router, on fresh random inputs.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported), so sizes stay tiny. The interpreter truncates fp32 -> bf16 instead of rounding to nearest, so
low-precision weights are compared to within one ulp of their dtype.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from agentrt_kernels.triton import route_topk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) on the weights, compared in their dtype: ~one ulp for fp16 / bf16
WEIGHT_TOL = {torch.float32: (1e-8, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
GAP = 1e-6  # relative gap between probabilities below which two choices count as tied


def _seed(*key) -> None:
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _torch_route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """engine.models.moe.SparseMoeBlock.route after the gate GEMV."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights.to(router_logits.dtype)


def _separated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() > GAP * torch.maximum(a.abs(), b.abs())


def _check_against_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    ids, weights = route_topk(logits, top_k, renormalize)
    ref_ids, ref_weights = _torch_route(logits, top_k, renormalize)
    tokens, experts = logits.shape
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    assert weights.shape == (tokens, top_k) and weights.dtype == logits.dtype
    assert ((ids >= 0) & (ids < experts)).all()
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct experts per row

    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    # what was picked is a top-k, in descending order (holds with ties too)
    torch.testing.assert_close(probs.gather(1, ids), sorted_probs[:, :top_k], atol=0, rtol=GAP)
    # where the k-th and (k+1)-th probabilities differ, the chosen set is the reference's
    if top_k < experts:
        clear = _separated(sorted_probs[:, top_k - 1], sorted_probs[:, top_k])
    else:
        clear = torch.ones(tokens, dtype=torch.bool, device=logits.device)
    for row in clear.nonzero().flatten().tolist():
        assert set(ids[row].tolist()) == set(ref_ids[row].tolist()), row
    # and each choice whose probability differs from its neighbours' sits where torch.topk put it
    top = sorted_probs[:, : top_k + 1]
    alone = torch.ones(tokens, top_k, dtype=torch.bool, device=logits.device)
    alone[:, 1:] &= _separated(top[:, 1:top_k], top[:, : top_k - 1])
    if top_k < experts:
        alone &= _separated(top[:, :top_k], top[:, 1 : top_k + 1])
    assert torch.equal(ids[alone], ref_ids[alone])

    atol, rtol = WEIGHT_TOL[logits.dtype]
    torch.testing.assert_close(weights.float(), ref_weights.float(), atol=atol, rtol=rtol)


# (tokens, top_k, renormalize): every K and every T meets both renormalize settings; T = 33 stays with
# small K because the interpreter's cost grows with T * K.
ROUTE_CASES = [(1, 1, True), (1, 8, False), (5, 2, False), (5, 8, True), (33, 1, False), (33, 2, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("experts", [8, 60, 128])  # 60: not a power of two (masked lanes)
def test_route_topk_matches_torch(dtype, experts):
    for tokens, top_k, renormalize in ROUTE_CASES:
        _seed("route", dtype, experts, tokens, top_k, renormalize)
        logits = (2.0 * torch.randn(tokens, experts, device=DEVICE)).to(dtype)
        _check_against_torch(logits, top_k, renormalize)


def test_route_topk_strided_rows():
    _seed("route-strided")
    wide = torch.randn(7, 80, device=DEVICE).to(torch.float16)
    logits = wide[:, 3:63]  # row stride 80, last dim contiguous
    for renormalize in (False, True):
        _check_against_torch(logits, 4, renormalize)


def test_route_topk_ties_take_lowest_index():
    for experts, top_k in ((8, 3), (60, 8)):
        logits = torch.full((2, experts), 0.5, device=DEVICE)
        for renormalize in (False, True):
            ids, weights = route_topk(logits, top_k, renormalize)
            assert ids.tolist() == [list(range(top_k))] * 2
            expect = 1.0 / (top_k if renormalize else experts)
            torch.testing.assert_close(weights, torch.full_like(weights, expect), atol=0, rtol=1e-6)
    # partial ties, and -inf logits picked (lowest index first) once the finite ones are used up
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0],
                           [float("-inf"), 2.0, float("-inf"), 1.0, float("-inf"), float("-inf")]],
                          device=DEVICE).to(torch.bfloat16)
    ids, weights = route_topk(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 0], [1, 3, 0, 2]]
    ref = F.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids).to(torch.bfloat16)
    torch.testing.assert_close(weights.float(), ref.float(), atol=8e-3, rtol=8e-3)
    assert weights[1, 2:].float().eq(0).all()


def test_route_topk_empty():
    ids, weights = route_topk(torch.empty(0, 16, device=DEVICE, dtype=torch.float16), 2, True)
    assert ids.shape == (0, 2) and ids.dtype == torch.int64
    assert weights.shape == (0, 2) and weights.dtype == torch.float16


def test_route_topk_rejects_bad_inputs():
    logits = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="2-D"):
        route_topk(logits[0], 2, True)
    with pytest.raises(ValueError, match="2-D"):
        route_topk(logits.view(2, 2, 8), 2, True)
    with pytest.raises(ValueError, match="contiguous"):
        route_topk(torch.randn(8, 4, device=DEVICE).t(), 2, True)
    for bad_k in (0, -1, 9):
        with pytest.raises(ValueError, match="top_k"):
            route_topk(logits, bad_k, False)
    with pytest.raises(ValueError, match="float"):
        route_topk(logits.to(torch.int32), 2, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_route_topk_cuda_graph():
    _seed("route-graph")
    logits = torch.randn(6, 64, device=DEVICE).to(torch.bfloat16)
    route_topk(logits, 4, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route_topk(logits, 4, True)
    logits.copy_(torch.randn(6, 64, device=DEVICE).to(torch.bfloat16))
    graph.replay()
    ref_ids, ref_weights = _torch_route(logits, 4, True)
    assert torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values)
    torch.testing.assert_close(weights.float(), ref_weights.float(), atol=8e-3, rtol=8e-3)
