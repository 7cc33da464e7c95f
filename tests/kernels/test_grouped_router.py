"""agentrt_kernels.triton.route_grouped_sigmoid (DeepSeek-V3 / GLM-4.7-Flash router epilogue: sigmoid, correction
bias, group top-2 scores, group top-k, top-k, renormalise, scale) vs the torch reference, on fresh random inputs.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported), so sizes stay tiny. The interpreter truncates fp32 -> bf16 instead of rounding to nearest, so
low-precision weights are compared to within one ulp of their dtype. The kernel orders its K experts by
descending corrected score while the reference's topk is unsorted, so ids are compared as sets and weights
per id. On CPU tensors ``ops.route_grouped_sigmoid`` must stay bit for bit the router's torch code from before
the op existed (copied below as ``_before_forward``).
"""

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from agentrt_kernels import ops  # noqa: E402
from agentrt_kernels.torch_ref import moe_router as ref  # noqa: E402
from agentrt_kernels.triton import route_grouped_sigmoid  # noqa: E402
from engine.models.deepseek_v3 import GroupedSigmoidRouter  # noqa: E402
from tests.kernels.test_moe_router import DEVICE, GAP, _seed  # noqa: E402  the softmax router's harness

# (atol, rtol) on the weights, compared in their dtype: ~one ulp for fp16 / bf16
WEIGHT_TOL = {torch.float32: (1e-7, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _separated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() > GAP * torch.maximum(a.abs(), b.abs())


def _clear_rows(logits, bias, top_k, groups, topk_groups) -> torch.Tensor:
    """Rows whose chosen groups and chosen experts are not decided by (near-)ties, where any correct
    implementation picks the reference's set."""
    choice = logits.float().sigmoid() + bias
    tokens, experts = choice.shape
    clear = torch.ones(tokens, dtype=torch.bool, device=choice.device)
    if groups > 1:
        group_scores = choice.view(tokens, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        ranked = group_scores.sort(dim=-1, descending=True)
        if topk_groups < groups:
            clear &= _separated(ranked.values[:, topk_groups - 1], ranked.values[:, topk_groups])
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, ranked.indices[:, :topk_groups], True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    if top_k < experts:
        top = choice.sort(dim=-1, descending=True).values
        clear &= _separated(top[:, top_k - 1], top[:, top_k])
    return clear


def _by_id(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _assert_clear_rows_agree(got, want, logits, bias, top_k, groups, topk_groups, atol, rtol, min_clear=1) -> None:
    """(ids, weights) ``got`` and ``want`` name the same experts with the same weights on every row the routing of
    ``logits`` does not decide by (near-)ties; at least ``min_clear`` such rows (random inputs: the comparison is
    not vacuous)."""
    clear = _clear_rows(logits, bias, top_k, groups, topk_groups)
    assert clear.sum() >= min_clear
    got_ids, got_weights = _by_id(got[0][clear], got[1][clear])
    want_ids, want_weights = _by_id(want[0][clear], want[1][clear])
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights.float(), want_weights.float(), atol=atol, rtol=rtol)


def _check_against_ref(logits, bias, top_k, groups, topk_groups, renormalize, scaling, out_dtype) -> None:
    args = (top_k, groups, topk_groups, renormalize, scaling, out_dtype)
    ids, weights = route_grouped_sigmoid(logits, bias, *args)
    ref_ids, ref_weights = ref.route_grouped_sigmoid(logits, bias, *args)
    tokens, experts = logits.shape
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    assert weights.shape == (tokens, top_k) and weights.dtype == out_dtype
    assert ((ids >= 0) & (ids < experts)).all()
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct experts per row

    atol, rtol = WEIGHT_TOL[out_dtype]
    _assert_clear_rows_agree((ids, weights), (ref_ids, ref_weights), logits, bias, top_k, groups, topk_groups, atol,
                             rtol)


def _random_inputs(tokens, experts, dtype=torch.float32):
    logits = (2.0 * torch.randn(tokens, experts, device=DEVICE)).to(dtype)
    bias = 0.2 * torch.randn(experts, device=DEVICE)
    return logits, bias


# (experts, top_k, groups, topk_groups, renormalize, scaling)
ROUTE_CASES = {
    "glm-4.7-flash": (64, 4, 1, 1, True, 1.8),
    "deepseek-v3-small": (64, 8, 8, 4, True, 2.5),
    "groups-no-renorm": (32, 4, 8, 4, False, 1.0),
    "no-groups-no-renorm": (16, 3, 1, 1, False, 0.75),
    "uneven-group-size": (60, 6, 4, 2, True, 1.5),  # 15 experts a group: padded lanes inside each group row
    "uneven-group-count": (48, 4, 6, 3, False, 2.0),  # 6 groups: padded group rows
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_route_grouped_sigmoid_matches_ref(out_dtype, case):
    experts, top_k, groups, topk_groups, renormalize, scaling = ROUTE_CASES[case]
    for tokens in (1, 5):
        _seed("grouped", case, out_dtype, tokens)
        logits, bias = _random_inputs(tokens, experts)
        _check_against_ref(logits, bias, top_k, groups, topk_groups, renormalize, scaling, out_dtype)


def test_route_grouped_sigmoid_low_precision_logits_and_strided_rows():
    _seed("grouped-bf16-strided")
    wide, bias = _random_inputs(6, 80, torch.bfloat16)
    logits = wide[:, 8:72]  # row stride 80, last dim contiguous
    _check_against_ref(logits, bias[:64].contiguous(), 8, 8, 4, True, 2.5, torch.bfloat16)


def _logit(p: list[float]) -> torch.Tensor:
    p = torch.tensor(p, dtype=torch.float64)
    return torch.log(p / (1 - p)).float()


def _both(logits, bias, *args):
    return [route_grouped_sigmoid(logits, bias, *args), ref.route_grouped_sigmoid(logits, bias, *args)]


def test_group_stage_scores_groups_by_their_top_two():
    # group 0 holds the best single expert but the worst-but-one pair; groups 1 and 2 have the best pairs
    probs = [[0.99, 0.01, 0.01, 0.01, 0.85, 0.80, 0.10, 0.10, 0.82, 0.78, 0.10, 0.10, 0.30, 0.30, 0.30, 0.30]]
    logits = _logit(probs).to(DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    for ids, weights in _both(logits, bias, 2, 4, 2, False, 1.0, torch.float32):
        assert sorted(ids[0].tolist()) == [4, 8]
        torch.testing.assert_close(weights[0].sort().values, torch.tensor([0.82, 0.85], device=DEVICE))
    # a max held twice scores twice the max: group 0 (0.7 + 0.7) beats group 1 (0.9 + 0.45)
    probs = [[0.70, 0.70, 0.10, 0.10, 0.90, 0.45, 0.10, 0.10, 0.20, 0.20, 0.10, 0.10, 0.20, 0.20, 0.10, 0.10]]
    logits = _logit(probs).to(DEVICE)
    for ids, _ in _both(logits, bias, 2, 4, 1, True, 1.0, torch.float32):
        assert sorted(ids[0].tolist()) == [0, 1]


def test_bias_chooses_but_does_not_weight():
    logits = _logit([[0.90, 0.80, 0.70, 0.60, 0.50, 0.40, 0.30, 0.20]]).to(DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    for renormalize, scaling in ((True, 1.8), (False, 2.5)):
        for ids, weights in _both(logits, bias, 2, 1, 1, renormalize, scaling, torch.float32):
            ids, weights = _by_id(ids, weights)
            assert ids[0].tolist() == [0, 2]  # expert 2 (0.7 + 0.5) beats expert 1 (0.8)
            expect = torch.tensor([0.9, 0.7], device=DEVICE)
            if renormalize:
                expect = expect / expect.sum()
            torch.testing.assert_close(weights[0], expect * scaling)


def test_ties_take_lowest_index():
    logits = torch.zeros(2, 16, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    ids, weights = route_grouped_sigmoid(logits, bias, 3, 4, 2, True, 1.0, torch.float32)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 3))
    # -inf choices still fill the K, lowest index first, weighted by their (finite) scores
    bias = torch.tensor([float("-inf")] * 6 + [0.0, 0.0], device=DEVICE)
    ids, weights = route_grouped_sigmoid(logits[:, :8], bias, 4, 1, 1, False, 1.0, torch.float32)
    assert ids.tolist() == [[6, 7, 0, 1]] * 2
    torch.testing.assert_close(weights, torch.full_like(weights, 0.5))
    # all scores 0 (logits -inf): renormalising gives 0 weights, not 0 / 0
    logits = torch.full((1, 16), float("-inf"), device=DEVICE)
    for ids, weights in _both(logits, torch.zeros(16, device=DEVICE), 2, 4, 2, True, 1.0, torch.float32):
        assert weights.eq(0).all()


def test_route_grouped_sigmoid_empty():
    ids, weights = route_grouped_sigmoid(torch.empty(0, 16, device=DEVICE), torch.zeros(16, device=DEVICE),
                                         2, 4, 2, True, 1.0, torch.bfloat16)
    assert ids.shape == (0, 2) and ids.dtype == torch.int64
    assert weights.shape == (0, 2) and weights.dtype == torch.bfloat16


def test_route_grouped_sigmoid_rejects_bad_inputs():
    logits = torch.randn(4, 16, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)

    def call(logits=logits, bias=bias, top_k=2, groups=4, topk_groups=2, out_dtype=torch.float32):
        route_grouped_sigmoid(logits, bias, top_k, groups, topk_groups, True, 1.0, out_dtype)

    bad = [
        ("2-D", dict(logits=logits[0])),
        ("2-D", dict(logits=logits.view(2, 2, 16))),
        ("router_logits must be float", dict(logits=logits.to(torch.int32))),
        ("out_dtype", dict(out_dtype=torch.int64)),
        ("contiguous", dict(logits=torch.randn(16, 4, device=DEVICE).t())),
        ("groups", dict(groups=3)),  # does not divide 16
        ("groups", dict(groups=0)),
        ("groups", dict(groups=16, topk_groups=2)),  # one expert a group has no top 2
        ("topk_groups", dict(topk_groups=0)),
        ("topk_groups", dict(topk_groups=5)),
        ("topk_groups", dict(top_k=5, topk_groups=1)),  # one group of 4 cannot hold 5 experts
        ("correction_bias", dict(bias=torch.zeros(8, device=DEVICE))),
        ("correction_bias", dict(bias=bias.half())),
    ]
    bad += [("top_k", dict(top_k=k)) for k in (0, -1, 17, True)]
    for match, kwargs in bad:
        with pytest.raises(ValueError, match=match):
            call(**kwargs)


def _before_forward(router, x):
    """GroupedSigmoidRouter.forward before ops.route_grouped_sigmoid: the CPU path must stay exactly this."""
    scores = F.linear(x.float(), router.weight).sigmoid()
    choice = scores + router.e_score_correction_bias
    if router.groups > 1:
        t, e = choice.shape
        group_scores = choice.view(t, router.groups, e // router.groups).topk(2, dim=-1)[0].sum(dim=-1)
        chosen = group_scores.topk(router.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // router.groups, dim=1), float("-inf"))
    topk_ids = choice.topk(router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk_ids)
    if router.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, (weights * router.scaling).to(x.dtype)


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_cpu_path_is_the_old_router(case):
    experts, top_k, groups, topk_groups, renormalize, scaling = ROUTE_CASES[case]
    config = types.SimpleNamespace(num_experts=experts, hidden_size=32, num_experts_per_tok=top_k,
                                   expert_groups=groups, topk_groups=topk_groups, norm_topk_prob=renormalize,
                                   routed_scaling_factor=scaling)
    router = GroupedSigmoidRouter(config)
    _seed("grouped-cpu", case)
    router.weight.copy_(0.3 * torch.randn(experts, 32))
    router.e_score_correction_bias.copy_(0.2 * torch.randn(experts))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 32).to(dtype)
        before = _before_forward(router, x)
        for ids, weights in (router(x), ops.route_grouped_sigmoid(
                F.linear(x.float(), router.weight), router.e_score_correction_bias, top_k, groups, topk_groups,
                renormalize, scaling, dtype)):
            assert torch.equal(ids, before[0]) and torch.equal(weights, before[1])


def test_ops_takes_the_kernel_when_triton(monkeypatch):
    monkeypatch.setattr(ops, "uses_triton", lambda x: True)
    _seed("grouped-ops")
    logits, bias = _random_inputs(5, 64)
    ids, weights = ops.route_grouped_sigmoid(logits, bias, 8, 8, 4, True, 2.5, torch.bfloat16)
    assert torch.equal(ids, route_grouped_sigmoid(logits, bias, 8, 8, 4, True, 2.5, torch.bfloat16)[0])
    assert weights.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_route_grouped_sigmoid_cuda_graph():
    _seed("grouped-graph")
    logits, bias = _random_inputs(6, 64)
    args = (8, 8, 4, True, 2.5, torch.bfloat16)
    route_grouped_sigmoid(logits, bias, *args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route_grouped_sigmoid(logits, bias, *args)
    logits.copy_(2.0 * torch.randn(6, 64, device=DEVICE))
    graph.replay()
    ref_ids, ref_weights = ref.route_grouped_sigmoid(logits, bias, *args)
    ids, weights = _by_id(ids, weights)
    ref_ids, ref_weights = _by_id(ref_ids, ref_weights)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.float(), ref_weights.float(), atol=8e-3, rtol=8e-3)


@pytest.mark.parametrize("case", ["glm-4.7-flash", "deepseek-v3-small"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_shared_expert_is_one_more_column_of_weight_one(case, out_dtype):
    """``shared_expert``: the routed columns as without it, then that id with weight exactly 1 in every row."""
    experts, top_k, groups, topk_groups, renormalize, scaling = ROUTE_CASES[case]
    _seed("shared", case, out_dtype)
    logits, bias = _random_inputs(5, experts)
    args = (top_k, groups, topk_groups, renormalize, scaling, out_dtype)
    for route in (route_grouped_sigmoid, ref.route_grouped_sigmoid):
        ids, weights = route(logits, bias, *args, shared_expert=experts)
        plain_ids, plain_weights = route(logits, bias, *args)
        assert ids.shape == weights.shape == (5, top_k + 1)
        assert torch.equal(ids[:, top_k], torch.full((5,), experts, device=DEVICE))
        assert torch.equal(weights[:, top_k], torch.ones(5, dtype=out_dtype, device=DEVICE))
        assert torch.equal(ids[:, :top_k], plain_ids) and torch.equal(weights[:, :top_k], plain_weights)
    with pytest.raises(ValueError, match="shared_expert"):
        route_grouped_sigmoid(logits, bias, *args, shared_expert=-2)


@pytest.mark.parametrize("case", ["glm-4.7-flash", "deepseek-v3-small", "uneven-group-size"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_routing_from_hidden_rows_equals_the_gate_product_then_routing(case, x_dtype):
    """The logits computed in the routing program (x . gate rows in fp32, hidden blocks of BLOCK_H, 300 columns:
    a partial block) route as ``F.linear(x.float(), gate)`` then the reference do, weights in x's dtype."""
    from agentrt_kernels.triton.grouped_router import route_grouped_sigmoid_from_hidden

    experts, top_k, groups, topk_groups, renormalize, scaling = ROUTE_CASES[case]
    _seed("hidden", case, x_dtype)
    hidden = 300  # three blocks of 128, the last partial
    x = torch.randn(5, hidden, device=DEVICE).to(x_dtype)
    gate = 0.2 * torch.randn(experts, hidden, device=DEVICE)
    bias = 0.2 * torch.randn(experts, device=DEVICE)
    args = (top_k, groups, topk_groups, renormalize, scaling, x_dtype)
    ids, weights = route_grouped_sigmoid_from_hidden(x, gate, bias, *args, shared_expert=experts)
    logits = torch.nn.functional.linear(x.float(), gate)
    ref_ids, ref_weights = ref.route_grouped_sigmoid(logits, bias, *args, shared_expert=experts)
    assert ids.shape == weights.shape == (5, top_k + 1) and weights.dtype == x_dtype
    atol, rtol = WEIGHT_TOL[x_dtype]
    _assert_clear_rows_agree((ids, weights), (ref_ids, ref_weights), logits, bias, top_k, groups, topk_groups,
                             max(atol, 1e-6), rtol)


def test_ops_routes_decode_rows_from_hidden_and_larger_batches_through_the_gemm(monkeypatch):
    """``ops.route_grouped_sigmoid_from_hidden``: on the kernel path a few rows over a small gate take the one-launch
    kernel; more rows than ``HIDDEN_ROUTE_MAX_ROWS`` take the gate GEMM and the logits kernel; on the CPU it is the
    router's torch code (the GEMM, then the reference) bit for bit."""
    from agentrt_kernels import ops
    from agentrt_kernels.triton import grouped_router

    calls = []
    for name in ("route_grouped_sigmoid", "route_grouped_sigmoid_from_hidden"):
        original = getattr(grouped_router, name)
        monkeypatch.setattr(grouped_router, name,
                            lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    gate, bias = 0.2 * torch.randn(16, 32), 0.2 * torch.randn(16)
    small, large = torch.randn(3, 32), torch.randn(grouped_router.HIDDEN_ROUTE_MAX_ROWS + 1, 32)
    cpu = [ops.route_grouped_sigmoid_from_hidden(x, gate, bias, 2, 1, 1, True, 1.5) for x in (small, large)]
    for x, got in zip((small, large), cpu):
        want = ref.route_grouped_sigmoid(torch.nn.functional.linear(x, gate), bias, 2, 1, 1, True, 1.5, x.dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert calls == []
    monkeypatch.setattr(ops, "uses_triton", lambda t: True)
    monkeypatch.setattr(ops, "_kernels", lambda module=None: grouped_router)
    for x in (small.to(DEVICE), large.to(DEVICE)):
        ops.route_grouped_sigmoid_from_hidden(x, gate.to(DEVICE), bias.to(DEVICE), 2, 1, 1, True, 1.5)
    assert calls == ["route_grouped_sigmoid_from_hidden", "route_grouped_sigmoid"]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(6, 300), (20, 2100)])
def test_routing_after_the_fused_norm_equals_the_norm_then_routing(x_dtype, tokens, hidden):
    """With ``norm`` and ``residual`` the program first adds the residual and takes the RMSNorm of the whole row
    (torch_ref.norm's math: the sum rounded to x's dtype, normalised in fp32, rounded, times the weight, rounded),
    then routes the normed rows: the new residual and the normed rows as the reference norm's, the routing as the
    reference's on those rows (GLM-4.7-Flash's grouping; 300 hidden columns: a partial gate block, the mean squares
    over unrolled chunks; 20 rows of 2100: more chunks than are unrolled, so a loop over them)."""
    from agentrt_kernels.torch_ref.norm import rms_norm
    from agentrt_kernels.triton.grouped_router import route_grouped_sigmoid_from_hidden

    experts, top_k, groups, topk_groups, renormalize, scaling = ROUTE_CASES["glm-4.7-flash"]
    _seed("hidden-norm", x_dtype, tokens)
    eps = 1e-5
    x = torch.randn(tokens, hidden, device=DEVICE).to(x_dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(hidden, device=DEVICE)).to(x_dtype)
    gate = 0.2 * torch.randn(experts, hidden, device=DEVICE)
    bias = 0.2 * torch.randn(experts, device=DEVICE)
    args = (top_k, groups, topk_groups, renormalize, scaling, x_dtype)
    ids, weights, normed, new_residual = route_grouped_sigmoid_from_hidden(
        x, gate, bias, *args, shared_expert=experts, norm=(weight, eps), residual=residual)
    want_normed, want_residual = rms_norm(x.cpu(), weight.cpu(), eps, residual.cpu())
    # the interpreter truncates each of the three bf16 roundings (see above); a GPU rounds them to nearest
    ulp = {torch.float32: 1e-6, torch.bfloat16: 3 * 2**-7 if DEVICE.type == "cpu" else 2**-8}[x_dtype]
    torch.testing.assert_close(new_residual.cpu().float(), want_residual.float(), atol=ulp, rtol=ulp)
    torch.testing.assert_close(normed.cpu().float(), want_normed.float(), atol=ulp, rtol=ulp)
    assert not torch.equal(normed, x) and not torch.equal(new_residual, x)
    logits = torch.nn.functional.linear(normed.float(), gate)
    ref_ids, ref_weights = ref.route_grouped_sigmoid(logits, bias, *args, shared_expert=experts)
    atol, rtol = WEIGHT_TOL[x_dtype]
    _assert_clear_rows_agree((ids, weights), (ref_ids, ref_weights), logits, bias, top_k, groups, topk_groups,
                             max(atol, 1e-6), rtol)
    with pytest.raises(ValueError, match="together"):
        route_grouped_sigmoid_from_hidden(x, gate, bias, *args, norm=(weight, eps))
    with pytest.raises(ValueError, match="norm weight"):
        route_grouped_sigmoid_from_hidden(x, gate, bias, *args, norm=(weight[:-1], eps), residual=residual)


def test_routing_from_hidden_rows_over_several_expert_blocks_and_a_partial_row_tile():
    """160 experts (the partial-logit program's expert blocks of 128, the last partial), 20 rows (a partial tile of
    32), 300 hidden columns (three slices, the last partial): the routing equals the gate product then the
    reference's."""
    from agentrt_kernels.triton.grouped_router import route_grouped_sigmoid_from_hidden

    experts, top_k, groups, topk_groups = 160, 6, 8, 3
    _seed("hidden-wide")
    x = torch.randn(20, 300, device=DEVICE)
    gate = 0.2 * torch.randn(experts, 300, device=DEVICE)
    bias = 0.2 * torch.randn(experts, device=DEVICE)
    args = (top_k, groups, topk_groups, True, 2.0, torch.float32)
    ids, weights = route_grouped_sigmoid_from_hidden(x, gate, bias, *args)
    logits = torch.nn.functional.linear(x, gate)
    ref_ids, ref_weights = ref.route_grouped_sigmoid(logits, bias, *args)
    _assert_clear_rows_agree((ids, weights), (ref_ids, ref_weights), logits, bias, top_k, groups, topk_groups, 1e-6,
                             1e-5, min_clear=10)
