"""agentrt_kernels.ops, the CPU/GPU switch: on fresh random inputs,

* on CPU tensors each op is its torch reference, bit for bit the torch code the models, the cache and the
  methods ran before the switch (copied below as ``_before_*``), and calling it does not import triton;
* with the Triton path taken (``ops.uses_triton`` forced on; without a GPU the kernels run in Triton's CPU
  interpreter, TRITON_INTERPRET=1, at tiny sizes) each op equals the reference within the tolerances of the
  kernel tests (tests/kernels/test_triton_kernels.py, test_moe_router.py, test_triton_selection.py).
"""

import importlib.util
import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agentrt_kernels import ops  # noqa: E402
from agentrt_kernels.torch_ref import activation, kv_store, moe, moe_router, norm, quest, rotary  # noqa: E402
from agentrt_kernels.torch_ref.decode_logits import paged_decode_logits as ref_decode_logits  # noqa: E402
from engine.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul  # noqa: E402

CPU = torch.device("cpu")
GPU_OR_CPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None
triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _seed(*key) -> None:
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _randn(*shape, dtype=torch.float32, device=CPU) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b)


def _close(out: torch.Tensor, ref: torch.Tensor, tol) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol[0], rtol=tol[1])


def _bf16_ulp_tol(dtype):
    """Elementwise kernels: exact in fp32/fp16, about an ulp in bf16 (interpreter truncation)."""
    return {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


@pytest.fixture
def on_triton(monkeypatch):
    """Every op takes its Triton path (compiled on a GPU, the interpreter on a CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(ops, "uses_triton", lambda x: True)


# --- the torch code each op replaced, as it ran before (engine/models, engine/paged_cache, policies/quest) -----


def _before_norm(x, weight, eps, residual=None):
    def _norm(x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    if residual is not None:
        residual = x + residual
        return _norm(residual), residual
    return _norm(x)


def _before_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _before_rotary(positions, q, k, cos_cache, sin_cache):
    def _rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _before_write(kv, k, v, slot_mapping):
    flat_shape = (-1, kv.shape[-2], kv.shape[-1])
    kv[0].view(flat_shape).index_copy_(0, slot_mapping, k.to(kv.dtype))
    kv[1].view(flat_shape).index_copy_(0, slot_mapping, v.to(kv.dtype))


def _before_experts(x, w_gate_up, w_down, topk_ids, topk_weights):
    top_k = topk_ids.shape[1]
    slots_by_expert = topk_ids.flatten().argsort(stable=True)
    tokens_by_expert = slots_by_expert // top_k
    weights_by_expert = topk_weights.flatten()[slots_by_expert]
    counts = torch.bincount(topk_ids.flatten(), minlength=w_gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = tokens_by_expert[start : start + count]
        h = _before_silu_and_mul(F.linear(x[tokens], w_gate_up[expert]))
        h = F.linear(h, w_down[expert]) * weights_by_expert[start : start + count, None]
        out.index_add_(0, tokens, h)
        start += count
    return out


def _before_route(router_logits, top_k, norm_topk_prob):
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights.to(router_logits.dtype)


def _before_quest_select(q, bt, kv_lens, k_cache, kmin_l, kmax_l, ps, budget, aggregate):
    """Quest._select_decode's torch path (world size 1): (block tables, lengths)."""
    width = bt.shape[1]
    lens = kv_lens.long()
    last = (lens - 1) // ps
    page = bt.gather(1, last[:, None]).squeeze(1).long()
    offset = lens - 1 - last * ps
    k_new = k_cache[page, offset]
    fresh = (offset == 0)[:, None, None]
    kmin_l[page] = torch.where(fresh, k_new, torch.minimum(kmin_l[page], k_new))
    kmax_l[page] = torch.where(fresh, k_new, torch.maximum(kmax_l[page], k_new))
    max_selected = budget // ps
    keep = max(-(-budget // ps), max_selected) - 1
    idx = bt.long()
    scores = quest.quest_page_scores(q, kmin_l[idx], kmax_l[idx], aggregate)
    cols = torch.arange(width, device=bt.device)
    scores = scores.masked_fill(cols[None, :] >= last[:, None], float("-inf"))
    k = min(keep, width)
    per_row = torch.where(lens <= budget, last, torch.clamp(last, max=max_selected - 1))
    if k > 0:
        top = scores.topk(k, dim=1)
        kept = (torch.arange(k, device=bt.device)[None, :] < per_row[:, None]) & (top.values > float("-inf"))
        picked = torch.where(kept, top.indices, width + top.indices).sort(dim=1).values
        count = kept.sum(dim=1)
    else:
        picked = torch.zeros(bt.shape[0], 0, dtype=torch.long, device=bt.device)
        count = torch.zeros_like(last)
    chosen = torch.cat([picked, torch.zeros_like(last)[:, None]], dim=1)
    chosen = torch.where(chosen >= width, 0, chosen)
    chosen.scatter_(1, count[:, None], last[:, None])
    new_lens = (count * ps + lens - last * ps).to(kv_lens.dtype)
    return bt.gather(1, chosen).to(bt.dtype), new_lens


# --- inputs ------------------------------------------------------------------------------------------------


def _rotary(dtype, head_dim, device, max_pos=128):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    rot = RotaryEmbedding(head_dim, 10000.0, scaling, max_pos).to(device)
    return rot.cos_cache.to(dtype), rot.sin_cache.to(dtype)


def _qkv(t, hq, hkv, d, dtype, device):
    """Strided q/k/v views of one packed projection, as the models produce them."""
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    return (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d),
            qkv[:, (hq + hkv) * d:].view(t, hkv, d))


def _paged(num_pages, page_size, hkv, d, dtype, device):
    return _randn(2, num_pages, page_size, hkv, d, dtype=dtype, device=device)


def _moe_inputs(dtype, device, tokens=9, experts=4, top_k=2, hidden=64, inter=32):
    x = _randn(tokens, hidden, dtype=dtype, device=device)
    w_gate_up = (_randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w_down = (_randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    probs = torch.softmax(_randn(tokens, experts, device=device), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    return x, w_gate_up, w_down, topk_weights.to(dtype), topk_ids


def _quest_inputs(dtype, device, page_size=4, hkv=2, group=2, d=32, kv_lens=(15, 21, 34, 54)):
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages).tolist()
    rows, pos = [], 0
    for n in need:
        rows.append(perm[pos:pos + n] + [0] * (max(need) - n))
        pos += n
    bt = torch.tensor(rows, dtype=torch.int32, device=device)
    k_cache = _randn(num_pages, page_size, hkv, d, dtype=dtype, device=device)
    q = _randn(len(kv_lens), hkv * group, d, dtype=dtype, device=device)
    kmin = _randn(num_pages, hkv, d, dtype=dtype, device=device)
    kmax = (kmin.float() + torch.rand(num_pages, hkv, d, device=device)).to(dtype)
    return q, bt, torch.tensor(kv_lens, dtype=torch.int32, device=device), k_cache, kmin, kmax


# --- CPU: the torch reference, bit for bit the code before ------------------------------------------------


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_rms_norm_is_the_reference(dtype):
    _seed("cpu-rms", dtype)
    x, res = _randn(6, 96, dtype=dtype), _randn(6, 96, dtype=dtype)
    w = (1 + 0.1 * _randn(96)).to(dtype)
    _equal(ops.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    _equal(ops.rms_norm(x, w, 1e-6), _before_norm(x, w, 1e-6))
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    want_out, want_res = _before_norm(x, w, 1e-6, res)
    _equal(out, want_out)
    _equal(new_res, want_res)
    layer = RMSNorm(96, 1e-6)
    layer.weight.data = w
    want = _before_norm(x, w, 1e-6)
    _equal(layer(x), want)
    _equal(layer._norm(x), want)
    q = _randn(5, 4, 64, dtype=dtype)  # a per-head (q/k) norm
    wq = (1 + 0.1 * _randn(64)).to(dtype)
    _equal(ops.rms_norm(q, wq, 1e-6), _before_norm(q, wq, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_silu_and_mul_is_the_reference(dtype):
    _seed("cpu-silu", dtype)
    x = 3 * _randn(7, 2 * 80, dtype=dtype)
    _equal(ops.silu_and_mul(x), activation.silu_and_mul(x))
    _equal(ops.silu_and_mul(x), _before_silu_and_mul(x))
    _equal(silu_and_mul(x), _before_silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_rotary_is_the_reference(dtype):
    _seed("cpu-rope", dtype)
    cos, sin = _rotary(dtype, 64, CPU)
    q, k, _ = _qkv(9, 6, 2, 64, dtype, CPU)
    q0, k0 = q.clone(), k.clone()
    positions = torch.randint(0, 128, (9,))
    got_q, got_k = ops.apply_rotary(positions, q, k, cos, sin)
    want_q, want_k = _before_rotary(positions, q, k, cos, sin)
    _equal(got_q, want_q)
    _equal(got_k, want_k)
    _equal(q, q0)  # the reference returns new tensors
    _equal(k, k0)
    ref_q, ref_k = rotary.apply_rotary(positions, q, k, cos, sin)
    _equal(got_q, ref_q)
    _equal(got_k, ref_k)
    layer = RotaryEmbedding(64, 10000.0, None, 128)
    layer.cos_cache, layer.sin_cache = cos, sin
    lq, lk = layer(positions, q, k)
    _equal(lq, want_q)
    _equal(lk, want_k)
    # with the per-head q/k norms first (Qwen3): the norms, then RoPE
    wq, wk = (1 + 0.3 * _randn(64)).to(dtype), (1 + 0.3 * _randn(64)).to(dtype)
    got_q, got_k = ops.apply_rotary(positions, q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-5)
    want_q, want_k = _before_rotary(positions, _before_norm(q, wq, 1e-5), _before_norm(k, wk, 1e-5), cos, sin)
    _equal(got_q, want_q)
    _equal(got_k, want_k)


@pytest.mark.parametrize("cache_dtype,src_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float32)])
def test_cpu_store_kv_is_the_reference(cache_dtype, src_dtype):
    _seed("cpu-store", cache_dtype, src_dtype)
    kv = _paged(7, 4, 2, 64, cache_dtype, CPU)
    _, k, v = _qkv(9, 4, 2, 64, src_dtype, CPU)
    slots = torch.randperm(7 * 4)[:9]
    want, ref = kv.clone(), kv.clone()
    _before_write(want, k, v, slots)
    kv_store.store_kv(k, v, ref[0], ref[1], slots)
    assert ops.store_kv(k, v, kv[0], kv[1], slots) is None
    _equal(kv, want)
    _equal(kv, ref)


@pytest.mark.parametrize("dtype,qk_norm,inplace_k", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                     (torch.float32, True, True)])
def test_cpu_rotary_and_store_is_write_rotated(dtype, qk_norm, inplace_k):
    """``CacheManager.write_rotated`` on the CPU: the q/k norms (``qk_norm``), RoPE, then ``write``."""
    _seed("cpu-rope-store", dtype, qk_norm, inplace_k)
    cos, sin = _rotary(dtype, 64, CPU)
    q, k, v = _qkv(7, 4, 2, 64, dtype, CPU)
    k0 = k.clone()
    positions = torch.randint(0, 128, (7,))
    slots = torch.randperm(5 * 4)[:7]
    kv = _paged(5, 4, 2, 64, dtype, CPU)
    want_kv = kv.clone()
    norm_kw = {}
    bq, bk = q, k
    if qk_norm:
        wq, wk = (1 + 0.3 * _randn(64)).to(dtype), (1 + 0.3 * _randn(64)).to(dtype)
        norm_kw = {"q_norm_weight": wq, "k_norm_weight": wk, "norm_eps": 1e-6}
        bq, bk = _before_norm(q, wq, 1e-6), _before_norm(k, wk, 1e-6)
    want_q, want_k = _before_rotary(positions, bq, bk, cos, sin)
    _before_write(want_kv, want_k, v, slots)
    got_q = ops.rotary_and_store(positions, q, k, v, cos, sin, kv[0], kv[1], slots, inplace_k=inplace_k, **norm_kw)
    _equal(got_q, want_q)
    _equal(kv, want_kv)
    _equal(k, want_k if inplace_k else k0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_cpu_route_topk_is_the_reference(dtype, renormalize):
    _seed("cpu-route", dtype, renormalize)
    logits = _randn(11, 8, dtype=dtype)
    ids, weights = ops.route_topk(logits, 2, renormalize)
    want_ids, want_weights = _before_route(logits, 2, renormalize)
    _equal(ids, want_ids)
    _equal(weights, want_weights)
    ref_ids, ref_weights = moe_router.route_topk(logits, 2, renormalize)
    _equal(ids, ref_ids)
    _equal(weights, ref_weights)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_fused_moe_is_the_reference(dtype):
    _seed("cpu-moe", dtype)
    x, w_gate_up, w_down, topk_weights, topk_ids = _moe_inputs(dtype, CPU, tokens=13, experts=6)
    got = ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    _equal(got, _before_experts(x, w_gate_up, w_down, topk_ids, topk_weights))
    _equal(got, moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids))


@pytest.mark.parametrize("aggregate", ["max", "sum"])
@pytest.mark.parametrize("budget", [4, 18, 40])
def test_cpu_quest_decode_selection_is_the_torch_path(aggregate, budget):
    """``quest_decode_scores``, the top-k, ``quest_decode_table``: Quest's torch decode selection before the
    switch -- the same table, lengths and updated page bounds."""
    _seed("cpu-quest", aggregate, budget)
    ps = 4
    q, bt, kv_lens, k_cache, kmin, kmax = _quest_inputs(torch.float32, CPU, page_size=ps)
    want_min, want_max = kmin.clone(), kmax.clone()
    want_bt, want_lens = _before_quest_select(q, bt, kv_lens, k_cache, want_min, want_max, ps, budget, aggregate)
    scores = ops.quest_decode_scores(q, kmin, kmax, k_cache, bt, kv_lens, ps, aggregate)
    _equal(kmin, want_min)
    _equal(kmax, want_max)
    max_selected = budget // ps
    keep = max(-(-budget // ps), max_selected) - 1
    top = scores.topk(min(keep, bt.shape[1]), dim=1)
    got_bt, got_lens = ops.quest_decode_table(top.values, top.indices, bt, kv_lens, ps, budget, max_selected - 1)
    _equal(got_bt, want_bt)
    _equal(got_lens, want_lens)


def test_cpu_method_ops_are_the_reference():
    """The ops the methods called through ``agentrt_kernels.dispatch`` (still importable there)."""
    from agentrt_kernels import dispatch
    from agentrt_kernels.torch_ref.received_attention import received_attention

    assert dispatch.window_votes is ops.window_votes and dispatch.quest_page_scores is ops.quest_page_scores
    assert dispatch.paged_decode_logits is ops.paged_decode_logits
    _seed("cpu-methods")
    q, bt, kv_lens, k_cache, kmin, kmax = _quest_inputs(torch.float32, CPU)
    pages = bt[:, :5].long()
    _equal(ops.quest_page_scores(q, kmin, kmax, pages, "sum"),
           quest.quest_page_scores(q, kmin[pages], kmax[pages], "sum"))
    lens = kv_lens.tolist()
    _equal(ops.paged_decode_logits(q, k_cache, bt, kv_lens, lens, 0.125, 60),
           ref_decode_logits(q, k_cache, bt, lens, 0.125, 60))
    n, w = lens[2], 5
    rows = _randn(w, q.shape[1], q.shape[2])
    page_ids = bt[2, : -(-n // 4)]
    _equal(ops.window_votes(rows, k_cache, page_ids, n, 0.125),
           received_attention(rows, k_cache, page_ids[None].to(torch.int32), [n], [w], 0.125)[0])


def test_cpu_ops_do_not_import_triton():
    """Importing the switch and running every reference on the CPU never imports triton (the import costs about a
    second, and the interpreter must be chosen before it)."""
    code = (
        "import sys, torch\n"
        "from agentrt_kernels import ops\n"
        "x = torch.randn(4, 8)\n"
        "ops.rms_norm(x, torch.ones(8), 1e-6, x); ops.silu_and_mul(x)\n"
        "ids, w = ops.route_topk(x, 2, True); ops.fused_moe(x, torch.randn(8, 8, 8), torch.randn(8, 8, 4), w, ids)\n"
        "q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8); cos = torch.randn(16, 4)\n"
        "kv = torch.zeros(2, 3, 2, 1, 8); pos = torch.arange(4)\n"
        "ops.apply_rotary(pos, q, k, cos, cos); ops.store_kv(k, k, kv[0], kv[1], pos)\n"
        "ops.rotary_and_store(pos, q, k, k, cos, cos, kv[0], kv[1], pos)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_triton_only_ops_call_the_kernel_module_at_call_time(monkeypatch):
    """The kernels without a reference here are looked up in their module at each call, so tests that wrap
    them there (test_fused_decode_linears, test_asym_encode) see the engine's and the methods' calls."""
    pytest.importorskip("triton")
    from agentrt_kernels.triton import asym_encode, cluster_decode, decode_linear

    calls = []
    for module, name in ((decode_linear, "decode_linear"), (cluster_decode, "cluster_decode_partials"),
                         (asym_encode, "encode_channel_groups"), (asym_encode, "encode_token_groups"),
                         (asym_encode, "supported")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **kw: calls.append((_n, len(a), sorted(kw))))
    ops.decode_linear(1, 2, norm=(3, 1e-6))
    ops.cluster_decode_partials(*range(10))
    ops.asym_encode_channel_groups(*range(7))
    ops.asym_encode_token_groups(*range(7))
    ops.asym_encode_supported(64, 4, 32)
    assert calls == [("decode_linear", 3, ["norm", "residual", "return_normed", "silu_mul"]),
                     ("cluster_decode_partials", 10, []), ("encode_channel_groups", 7, []),
                     ("encode_token_groups", 7, []), ("supported", 3, [])]


# --- the Triton path: the kernels equal the reference -------------------------------------------------------


D = GPU_OR_CPU
TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@triton_only
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_rms_norm(dtype, on_triton):
    _seed("tr-rms", dtype)
    x, res = _randn(6, 96, dtype=dtype, device=D), _randn(6, 96, dtype=dtype, device=D)
    w = (1 + 0.1 * _randn(96, device=D)).to(dtype)
    _close(ops.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6), _bf16_ulp_tol(dtype))
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    want_out, want_res = norm.rms_norm(x, w, 1e-6, res)
    _close(new_res, want_res, (0, 0) if dtype != torch.bfloat16 else _bf16_ulp_tol(dtype))
    _close(out, want_out, _bf16_ulp_tol(dtype))


@triton_only
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_silu_and_mul(dtype, on_triton):
    _seed("tr-silu", dtype)
    x = 3 * _randn(7, 2 * 80, dtype=dtype, device=D)
    _close(ops.silu_and_mul(x), activation.silu_and_mul(x), _bf16_ulp_tol(dtype))


@triton_only
@pytest.mark.parametrize("dtype,qk_norm", [(torch.float32, False), (torch.float16, True), (torch.bfloat16, False)])
def test_triton_apply_rotary(dtype, qk_norm, on_triton):
    _seed("tr-rope", dtype, qk_norm)
    cos, sin = _rotary(dtype, 64, D)
    q, k, _ = _qkv(9, 6, 2, 64, dtype, D)
    positions = torch.randint(0, 128, (9,), device=D)
    norm_kw = {}
    if qk_norm:
        norm_kw = {"q_norm_weight": (1 + 0.3 * _randn(64, device=D)).to(dtype),
                   "k_norm_weight": (1 + 0.3 * _randn(64, device=D)).to(dtype), "norm_eps": 1e-6}
    want_q, want_k = rotary.apply_rotary(positions, q.clone(), k.clone(), cos, sin, **norm_kw)
    got_q, got_k = ops.apply_rotary(positions, q, k, cos, sin, **norm_kw)
    assert got_q is q and got_k is k  # the kernel rotates in place
    _close(got_q, want_q, _bf16_ulp_tol(dtype))
    _close(got_k, want_k, _bf16_ulp_tol(dtype))


@triton_only
@pytest.mark.parametrize("cache_dtype,src_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float32)])
def test_triton_store_kv(cache_dtype, src_dtype, on_triton):
    _seed("tr-store", cache_dtype, src_dtype)
    kv = _paged(7, 4, 2, 64, cache_dtype, D)
    _, k, v = _qkv(9, 4, 2, 64, src_dtype, D)
    slots = torch.randperm(7 * 4, device=D)[:9]
    want = kv.clone()
    kv_store.store_kv(k, v, want[0], want[1], slots)
    ops.store_kv(k, v, kv[0], kv[1], slots)
    _close(kv, want, (0, 0) if cache_dtype == src_dtype else (1e-3, 1e-3))


@triton_only
@pytest.mark.parametrize("dtype,qk_norm,inplace_k", [(torch.float32, False, False), (torch.float16, True, True),
                                                     (torch.bfloat16, False, True)])
def test_triton_rotary_and_store(dtype, qk_norm, inplace_k, on_triton):
    _seed("tr-rope-store", dtype, qk_norm, inplace_k)
    cos, sin = _rotary(dtype, 64, D)
    q, k, v = _qkv(7, 4, 2, 64, dtype, D)
    positions = torch.randint(0, 128, (7,), device=D)
    slots = torch.randperm(5 * 4, device=D)[:7]
    kv = _paged(5, 4, 2, 64, dtype, D)
    norm_kw = {}
    if qk_norm:
        norm_kw = {"q_norm_weight": (1 + 0.3 * _randn(64, device=D)).to(dtype),
                   "k_norm_weight": (1 + 0.3 * _randn(64, device=D)).to(dtype), "norm_eps": 1e-6}
    want_kv, want_k = kv.clone(), k.clone()
    want_q = rotary.rotary_and_store(positions, q.clone(), want_k, v, cos, sin, want_kv[0], want_kv[1], slots,
                                     inplace_k=True, **norm_kw)
    k0 = k.clone()
    got_q = ops.rotary_and_store(positions, q, k, v, cos, sin, kv[0], kv[1], slots, inplace_k=inplace_k, **norm_kw)
    tol = _bf16_ulp_tol(dtype)
    _close(got_q, want_q, tol)
    _close(kv[0], want_kv[0], tol)
    _close(kv[1], want_kv[1], (0, 0))
    _close(k, want_k if inplace_k else k0, tol if inplace_k else (0, 0))


@triton_only
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_triton_route_topk(dtype, renormalize, on_triton):
    _seed("tr-route", dtype, renormalize)
    logits = _randn(5, 8, dtype=dtype, device=D)
    ids, weights = ops.route_topk(logits, 2, renormalize)
    want_ids, want_weights = moe_router.route_topk(logits, 2, renormalize)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    # the chosen experts carry the reference's probabilities (the same set, up to the order of exact ties)
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, want_ids), atol=0, rtol=1e-6)
    atol, rtol = {torch.float32: (1e-8, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[dtype]
    torch.testing.assert_close(weights.float(), want_weights.float(), atol=atol, rtol=rtol)


@triton_only
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_fused_moe(dtype, on_triton):
    _seed("tr-moe", dtype)
    x, w_gate_up, w_down, topk_weights, topk_ids = _moe_inputs(dtype, D)
    got = ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert got.dtype == dtype
    want = moe.fused_moe(x.float(), w_gate_up.float(), w_down.float(), topk_weights.float(), topk_ids)
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}[dtype]
    _close(got, want, tol)


@triton_only
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_topk_sum_is_torchs_sum(dtype):
    """The fused MoE's last launch: each token's k rows summed in fp32 and rounded once, as torch sums a bf16 /
    fp16 dim (bit for bit at these magnitudes), over a partial last column block."""
    from agentrt_kernels.triton.moe import TOPK_SUM_BLOCK, topk_sum

    _seed("tr-topk-sum", dtype)
    tokens, k, hidden = 3, 5, TOPK_SUM_BLOCK + 40
    rows = _randn(tokens * k, hidden, dtype=dtype, device=D)
    got = topk_sum(rows, tokens, k)
    want = rows.view(tokens, k, hidden).sum(dim=1)
    if dtype == torch.float32:  # fp32 sums in another order: within rounding
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    elif dtype == torch.bfloat16 and D.type == "cpu":  # the interpreter truncates bf16 stores: an ulp
        torch.testing.assert_close(got.float(), want.float(), atol=2**-7, rtol=2**-7)
    else:
        assert torch.equal(got, want)


@triton_only
@pytest.mark.parametrize("dtype,aggregate", [(torch.float32, "max"), (torch.float16, "sum")])
def test_triton_quest_ops(dtype, aggregate, on_triton):
    """Page scores, the decode scores (with their bounds update) and the selected table."""
    _seed("tr-quest", dtype, aggregate)
    ps, budget = 4, 18
    q, bt, kv_lens, k_cache, kmin, kmax = _quest_inputs(dtype, D, page_size=ps)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (3e-3, 3e-3)
    pages = bt[:, :5].long()
    _close(ops.quest_page_scores(q, kmin, kmax, pages, aggregate),
           quest.quest_page_scores(q, kmin[pages], kmax[pages], aggregate), tol)
    want_min, want_max = kmin.clone(), kmax.clone()
    want = quest.quest_decode_scores(q, want_min, want_max, k_cache, bt, kv_lens, ps, aggregate)
    got = ops.quest_decode_scores(q, kmin, kmax, k_cache, bt, kv_lens, ps, aggregate)
    _equal(kmin, want_min)
    _equal(kmax, want_max)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    _close(got[finite], want[finite], tol)
    max_selected = budget // ps
    top = want.topk(min(max_selected, bt.shape[1]), dim=1)
    got_bt, got_lens = ops.quest_decode_table(top.values, top.indices, bt, kv_lens, ps, budget, max_selected - 1)
    want_bt, want_lens = quest.quest_decode_table(top.values, top.indices, bt, kv_lens, ps, budget, max_selected - 1)
    _equal(got_bt, want_bt)
    _equal(got_lens, want_lens)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_logits_and_window_votes(dtype, on_triton):
    _seed("tr-logits", dtype)
    q, bt, kv_lens, k_cache, _, _ = _quest_inputs(dtype, D, d=64)
    lens = kv_lens.tolist()
    tol = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3)}[dtype]
    got = ops.paged_decode_logits(q, k_cache, bt, kv_lens, lens, 0.125, 60)
    want = ref_decode_logits(q, k_cache, bt, lens, 0.125, 60)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    _close(got[finite], want[finite], tol)
    n, w = lens[3], 8
    rows = _randn(w, q.shape[1], q.shape[2], dtype=dtype, device=D)
    page_ids = bt[3, : -(-n // 4)]
    _close(ops.window_votes(rows, k_cache, page_ids, n, 0.125),
           ops.window_votes(rows, k_cache, page_ids, n, 0.125, use_triton=False),
           (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-3))
