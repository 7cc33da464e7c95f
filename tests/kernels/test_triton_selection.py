"""The Triton backend's selection and score paths against the torch reference backend.

Decode-attention logits (the kernel H2O, TOVA and OmniKV rank slots with), selected-slot views read as a
page-size-1 table, and scores returned at decode and prefill steps. Runs compiled on a GPU, or in Triton's
CPU interpreter (TRITON_INTERPRET=1) at tiny sizes.
"""

import dataclasses
import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.attention_backend import TorchReferenceBackend  # noqa: E402
from engine.contract.view import PagedView, SelectedSlotsView  # noqa: E402
from engine.gpu_backends import TritonBackend  # noqa: E402
from agentrt_kernels.torch_ref import paged_decode_logits as ref_logits  # noqa: E402
from agentrt_kernels.triton import paged_decode_logits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3)}


def _seed(*key):
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _setup(kv_lens, page_size, hkv, group, d, dtype, query_lens=None):
    query_lens = query_lens or [1] * len(kv_lens)
    need = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages).tolist()
    rows, pos = [], 0
    for n in need:
        rows.append(perm[pos:pos + n] + [0] * (max(need) - n))
        pos += n
    bt = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    k = torch.randn(num_pages, page_size, hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, d, device=DEVICE).to(dtype)
    q = torch.randn(sum(query_lens), hkv * group, d, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    view = PagedView(block_tables=bt, kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
                     query_start_loc=qsl, page_size=page_size, kv_lens_cpu=list(kv_lens),
                     query_lens_cpu=list(query_lens))
    return q, k, v, view


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol[0], rtol=tol[1])


# WIDE: a head wider than 256 channels, taken in 64-channel slices (an MLA latent is 576), the last one partial
WIDE = 288


@pytest.mark.parametrize("dtype,group,page_size,block_n,d", [
    (torch.float32, 1, 4, 16, 64), (torch.float16, 4, 16, 16, 64), (torch.float16, 3, 1, 32, 64),
    (torch.float32, 2, 8, 64, 64), (torch.float32, 4, 8, 16, WIDE), (torch.float16, 2, 16, 32, WIDE)])
def test_decode_logits_match_reference(dtype, group, page_size, block_n, d):
    _seed("logits", dtype, group, page_size, d)
    kv_lens = [1, 37, 16, 70]
    q, k, _, view = _setup(kv_lens, page_size, 2, group, d, dtype)
    got = paged_decode_logits(q, k, view.block_tables, view.kv_lens, 0.125, width=80, block_n=block_n)
    ref = ref_logits(q, k, view.block_tables, kv_lens, 0.125, width=80)
    assert got.shape == ref.shape == (4, 2 * group, 80)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    _close(got[finite], ref[finite], TOL[dtype])


def _selected(view, keep_fraction, query_lens):
    """A random ascending subset of each request's slots that always ends with its newest query tokens."""
    pieces, counts = [], []
    for i, (n, ql) in enumerate(zip(view.kv_lens_cpu, query_lens)):
        older = torch.randperm(n - ql)[: max(1, int((n - ql) * keep_fraction))].sort().values if n > ql else \
            torch.empty(0, dtype=torch.long)
        pos = torch.cat([older, torch.arange(n - ql, n)]).to(DEVICE)
        ps = view.page_size
        pieces.append(view.block_tables[i, pos // ps].long() * ps + pos % ps)
        counts.append(len(pos))
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.long, device=DEVICE)
    return SelectedSlotsView(
        block_tables=view.block_tables, kv_lens=torch.tensor(counts, dtype=torch.int32, device=DEVICE),
        query_start_loc=view.query_start_loc, page_size=view.page_size, kv_lens_cpu=counts,
        query_lens_cpu=view.query_lens_cpu, slot_indptr=indptr, slot_indices=torch.cat(pieces))


def _padded(view: SelectedSlotsView, stride: int) -> SelectedSlotsView:
    """The same lists laid out with a fixed stride per request (junk past each count) plus the one-slot-page
    table a method builds on the device (OmniKV's decode path)."""
    rows = []
    for i, n in enumerate(view.kv_lens_cpu):
        a = int(view.slot_indptr[i])
        row = view.slot_indices[a:a + n]
        rows.append(torch.cat([row, torch.full((stride - n,), 7, dtype=row.dtype, device=row.device)]))
    table = torch.stack(rows)
    valid = torch.arange(stride, device=table.device)[None, :] < view.kv_lens[:, None]
    return dataclasses.replace(
        view, slot_indptr=torch.arange(len(rows) + 1, device=table.device) * stride,
        slot_indices=table.flatten(), slot_table=torch.where(valid, table, 0).to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_lens", [None, [1, 5, 1, 9]])
@pytest.mark.parametrize("selected", [False, True, "padded"])
def test_triton_backend_matches_torch_backend(dtype, query_lens, selected):
    _seed("backend", dtype, query_lens, selected)
    kv_lens = [3, 37, 16, 70]
    q, k, v, view = _setup(kv_lens, 8, 2, 2, 64, dtype, query_lens)
    if selected:
        view = _selected(view, 0.4, view.query_lens_cpu)
    if selected == "padded":
        view = _padded(view, max(view.kv_lens_cpu) + 3)
    for scores in (False, True):
        out, probs = TritonBackend().forward(q, k, v, view, 0.125, return_scores=scores)
        ref_out, ref_probs = TorchReferenceBackend().forward(q, k, v, view, 0.125, return_scores=scores)
        _close(out, ref_out, TOL[dtype])
        if not scores:
            assert probs is None
            continue
        assert len(probs) == len(ref_probs) == len(kv_lens)
        for p, r in zip(probs, ref_probs):
            assert p.shape == r.shape
            _close(p, r, (1e-4, 1e-3) if dtype == torch.float16 else (1e-6, 1e-5))


@pytest.mark.parametrize("dtype,group,aggregate,block_p,d", [
    (torch.float32, 1, "max", 16, 64), (torch.float16, 4, "sum", 32, 64), (torch.float16, 3, "max", 8, 64),
    (torch.float32, 2, "sum", 64, 64), (torch.float32, 2, "max", None, WIDE)])
def test_quest_page_scores_match_reference(dtype, group, aggregate, block_p, d):
    from agentrt_kernels.torch_ref import quest_page_scores as ref_scores
    from agentrt_kernels.triton import quest_page_scores

    _seed("quest", dtype, group, aggregate, d)
    num_pages, hkv = 40, 2
    kmin = torch.randn(num_pages, hkv, d, device=DEVICE).to(dtype)
    kmax = kmin + torch.rand(num_pages, hkv, d, device=DEVICE).to(dtype)
    q = torch.randn(3, hkv * group, d, device=DEVICE).to(dtype)
    pages = torch.stack([torch.randperm(num_pages, device=DEVICE)[:37] for _ in range(3)]).to(torch.int32)
    got = quest_page_scores(q, kmin, kmax, pages, aggregate, block_p=block_p)
    idx = pages.long()
    ref = ref_scores(q, kmin[idx], kmax[idx], aggregate)
    assert got.shape == ref.shape == (3, 37)
    _close(got, ref, (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-3))


@pytest.mark.parametrize("dtype,group,page_size,causal,reduce", [
    (torch.float32, 2, 4, True, "sum"), (torch.float16, 4, 16, True, "sum"), (torch.float16, 3, 8, True, "sum"),
    (torch.float32, 1, 8, False, "sum"), (torch.float32, 2, 4, True, "max"), (torch.float16, 3, 8, True, "max"),
    (torch.float32, 1, 1, False, "max")])
def test_received_attention_matches_reference(dtype, group, page_size, causal, reduce):
    """Prefill with lse= then the column pass equals the reference's summed (maximised) probabilities."""
    from agentrt_kernels.torch_ref import paged_attention
    from agentrt_kernels.torch_ref.received_attention import received_attention as ref_received
    from agentrt_kernels.triton import paged_prefill_attention
    from agentrt_kernels.triton.received_attention import received_attention

    _seed("received", dtype, group, page_size, causal, reduce)
    kv_lens, query_lens = [37, 16, 70, 9], [37, 5, 20, 1]  # a whole prompt, extends, a decode row
    q, k, v, view = _setup(kv_lens, page_size, 2, group, 64, dtype, query_lens)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=DEVICE)
    out = paged_prefill_attention(q, k, v, view.block_tables, view.kv_lens, view.query_start_loc, 0.125,
                                  causal=causal, max_query_len=max(query_lens), lse=lse)
    ref_out, _ = paged_attention(q, k, v, view.block_tables, kv_lens, query_lens, 0.125, causal=causal)
    _close(out, ref_out, TOL[dtype])
    got = received_attention(q, k, view.block_tables, view.kv_lens, view.query_start_loc, lse, 0.125,
                             width=max(kv_lens), max_query_len=max(query_lens), causal=causal, block_n=16,
                             reduce=reduce)
    ref = ref_received(q, k, view.block_tables, kv_lens, query_lens, 0.125, causal=causal, chunk=7, reduce=reduce)
    _, probs = paged_attention(q, k, v, view.block_tables, kv_lens, query_lens, 0.125, causal=causal,
                               return_scores=True)  # the full matrices, reduced: the definition
    for r, p in zip(ref, probs):
        rows = p.view(2, group, *p.shape[1:])  # [Hkv, group, query_len, kv_len]
        _close(r, rows.sum(dim=(1, 2)) if reduce == "sum" else rows.amax(dim=(1, 2)), (1e-5, 1e-5))
    for i, r in enumerate(ref):
        assert torch.all(got[i, :, kv_lens[i]:] == 0)
        _close(got[i, :, : kv_lens[i]], r, (2e-3, 2e-3) if dtype == torch.float16 else (1e-5, 1e-5))
        if reduce == "sum":  # every query row's probabilities sum to 1: the slots receive query_len * group
            torch.testing.assert_close(r.sum().cpu(), torch.tensor(float(query_lens[i] * group * 2)), atol=1e-3,
                                       rtol=1e-4)
        else:
            assert float(r.max()) <= 1.0 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("selected", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_backends_agree_on_received_attention(dtype, selected, reduce):
    _seed("forward_received", dtype, selected, reduce)
    kv_lens, query_lens = [3, 37, 16, 70], [3, 1, 9, 1]
    q, k, v, view = _setup(kv_lens, 8, 2, 2, 64, dtype, query_lens)
    if selected:
        view = _selected(view, 0.4, view.query_lens_cpu)
    out, received = TritonBackend().forward_received(q, k, v, view, 0.125, 2, reduce=reduce)
    ref_out, ref_received = TorchReferenceBackend().forward_received(q, k, v, view, 0.125, 2, reduce=reduce)
    _close(out, ref_out, TOL[dtype])
    assert [r.shape for r in received] == [r.shape for r in ref_received] == [(2, n) for n in view.kv_lens_cpu]
    for r, g in zip(ref_received, received):
        _close(g, r, (2e-3, 2e-3) if dtype == torch.float16 else (1e-5, 1e-5))


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_probe_through_the_triton_backend_equals_the_reference_probe(tiny_dirs, reduce):
    """The probe forward (KVzip's reconstruction, SnapKV-global's votes) with the Triton backend's fused
    received attention equals the probe that forms every probability matrix in fp32."""
    import copy
    import random

    from engine import LLM, SamplingParams
    from tests.chain_helpers import random_tokens, run_chain_turn

    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=str(DEVICE), page_size=4, max_num_batched_tokens=16,
              num_pages=256)  # a page count: on a GPU other test workers hold memory a utilization share misjudges
    engine, rng = llm.engine, random.Random(2)
    run_chain_turn(engine, "c", random_tokens(rng, 29), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    state = engine.chains.index.get("c")
    fused, reference = copy.copy(engine.chains.prober), copy.copy(engine.chains.prober)
    fused.backend, reference.backend = TritonBackend(), None
    probe = random_tokens(rng, 9)
    got = fused.run(state.table, state.num_computed, probe, reduce=reduce, chunk_size=4)
    want = reference.run(state.table, state.num_computed, probe, reduce=reduce, chunk_size=4)
    for g, w in zip(got, want):
        _close(g, w, (1e-4, 1e-6))


@pytest.mark.parametrize("dtype,group,page_size,causal,d", [
    (torch.float32, 2, 4, True, 64), (torch.float16, 4, 16, True, 64), (torch.float32, 1, 8, False, 64),
    (torch.float32, 3, 8, True, WIDE)])
def test_key_split_lse_matches_logsumexp(dtype, group, page_size, causal, d):
    """``paged_lse`` (partial max / sum per key tile, merged) equals torch's log-sum-exp of the same logits."""
    from agentrt_kernels.triton.received_attention import paged_lse

    _seed("lse", dtype, group, page_size, causal, d)
    kv_lens, query_lens = [37, 16, 70, 9], [3, 5, 32, 1]
    q, k, _, view = _setup(kv_lens, page_size, 2, group, d, dtype, query_lens)
    got = paged_lse(q, k, view.block_tables, view.kv_lens, view.query_start_loc, 0.125, max(kv_lens),
                    max(query_lens), causal=causal, block_n=16)
    start = 0
    for i, (n, m) in enumerate(zip(kv_lens, query_lens)):
        pages = view.block_tables[i, : -(-n // page_size)].long()
        keys = k[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        logits = torch.einsum("thd,shd->ths", q[start:start + m].float(), keys) * 0.125 * math.log2(math.e)
        if causal:
            hidden = torch.arange(n, device=DEVICE)[None, :] > (n - m + torch.arange(m, device=DEVICE))[:, None]
            logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
        want = torch.logsumexp(logits * math.log(2), dim=-1) / math.log(2)
        _close(got[start:start + m], want, (1e-4, 1e-5) if dtype == torch.float32 else (3e-3, 3e-3))
        start += m


def test_the_lse_merge_kernel_equals_the_torch_merge():
    """``merge_lse`` (one launch) against the torch merge it replaced, with tiles that saw no slot (-inf max, 0 sum),
    rows no tile saw and more entries than one program's block."""
    from agentrt_kernels.torch_ref.received_attention import merge_lse as reference
    from agentrt_kernels.triton.received_attention import merge_lse

    _seed("merge")
    m = 8 * torch.randn(5, 7, 40, device=DEVICE)
    l = torch.rand(5, 7, 40, device=DEVICE) + 0.1
    unseen = torch.rand(5, 7, 40, device=DEVICE) < 0.3
    m, l = m.masked_fill(unseen, float("-inf")), l.masked_fill(unseen, 0.0)
    m[:, 2, 3], l[:, 2, 3] = float("-inf"), 0.0  # a row no tile saw
    got, want = merge_lse(m, l), reference(m, l)
    assert torch.isneginf(got[2, 3]) and torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    _close(got[finite], want[finite], (1e-5, 1e-6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches")
def test_a_vote_compiles_the_same_kernels_at_any_history_length():
    """A chain's history length changes every turn: the vote's kernels take it (and the key-tile count) as runtime
    values, so every length launches kernels of the same constexprs (on a GPU no compilation after the first
    turn, where a constexpr following the length would compile a kernel per length), and their full
    specialization keys stay a few whatever the lengths; one layer's vote and all layers' alike."""
    from agentrt_kernels.ops import window_vote_inputs, window_votes_with
    from tests.kernel_variants import recorded_launches

    _seed("variants")
    num_layers, num_pages, page_size, hkv, group, w, d = 3, 160, 8, 2, 2, 16, 64
    pool = torch.randn(num_layers, 2, num_pages, page_size, hkv, d, device=DEVICE)  # as DenseKV.all_layer_keys
    constexprs = []
    with recorded_launches() as every:
        for n in (150, 333, 421, 1000, 1227):
            pages = torch.randperm(num_pages, device=DEVICE)[: -(-n // page_size)].to(torch.int32)
            q = torch.randn(num_layers * w, hkv * group, d, device=DEVICE)
            with recorded_launches() as launches:  # one layer's vote, then every layer's as rows of one table
                window_votes_with(window_vote_inputs(pages, n, w, DEVICE), q[:w], pool[0, 0], d ** -0.5,
                                  use_triton=True)
                inputs = window_vote_inputs(pages, n, w, DEVICE, [layer * 2 * num_pages for layer in range(3)])
                window_votes_with(inputs, q, pool.view(-1, page_size, hkv, d), d ** -0.5, use_triton=True)
            assert sum(map(len, launches.constexprs.values())) == 3, launches.constexprs  # the same three twice
            constexprs.append(dict(launches.constexprs))
    assert all(c == constexprs[0] for c in constexprs), [c for c in constexprs if c != constexprs[0]]
    assert all(len(keys) <= 4 for keys in every.keys.values()), {k: len(v) for k, v in every.keys.items()}


def test_layers_voting_through_one_inputs_equal_separate_votes():
    """Layers of one length share one ``window_vote_inputs`` (the page row and lengths on the device) and write into
    the rows of one buffer: every layer's votes equal a separate ``window_votes`` call's, bit for bit, and the
    torch reference's."""
    from agentrt_kernels.ops import window_vote_inputs, window_votes, window_votes_with

    _seed("shared-inputs")
    # 40 rows of 4 query heads: query tiles of 16 rows, so the window's early rows skip the last key tile (the
    # partials' entries no layer writes, which must keep their fill)
    n, w, page_size, d = 150, 40, 8, 64
    layers = [_setup([n], page_size, 2, 4, d, torch.float32, [w]) for _ in range(3)]
    pages = layers[0][3].block_tables[0, : -(-n // page_size)]
    inputs = window_vote_inputs(pages, n, w, DEVICE)
    rows = torch.full((3, 2, n), float("nan"), device=DEVICE)
    for i, (q, k, _, _) in enumerate(layers):
        window_votes_with(inputs, q, k, d ** -0.5, use_triton=True, out=rows[i:i + 1])
    for i, (q, k, _, _) in enumerate(layers):
        assert torch.equal(rows[i], window_votes(q, k, pages, n, d ** -0.5, use_triton=True))
        _close(rows[i], window_votes(q, k, pages, n, d ** -0.5, use_triton=False), (1e-4, 1e-5))


@pytest.mark.parametrize("d", [64, WIDE])
def test_layers_voting_as_rows_of_one_block_table_equal_separate_votes(d):
    """Every layer's keys in one paged tensor (the dense pool [L, 2, P, ...] seen as 2 * L * P pages, as
    ``DenseKV.all_layer_keys`` gives it) and the layers as rows of one block table (``page_offsets``): one call's
    [L, Hkv, n] votes equal each layer's own ``window_votes`` over its [P, ...] keys, bit for bit on the kernels,
    and the torch reference's; a layer's offset mistaken reads another layer's keys."""
    from agentrt_kernels.ops import window_vote_inputs, window_votes, window_votes_with

    _seed("stacked-layers", d)
    num_layers, num_pages, page_size, hkv, group, n, w = 3, 24, 8, 2, 3, 150, 24
    pool = torch.randn(num_layers, 2, num_pages, page_size, hkv, d, device=DEVICE)
    pages = torch.randperm(num_pages, device=DEVICE)[: -(-n // page_size)].to(torch.int32)
    qs = [torch.randn(w, hkv * group, d, device=DEVICE) for _ in range(num_layers)]
    layers = [2, 0]  # any subset, in any order
    inputs = window_vote_inputs(pages, n, w, DEVICE, [layer * 2 * num_pages for layer in layers])
    keys = pool.view(-1, page_size, hkv, d)
    q = torch.cat([qs[layer] for layer in layers])
    for use_triton in (True, False):
        out = torch.full((len(layers), hkv, n), float("nan"), device=DEVICE)
        got = window_votes_with(inputs, q, keys, d ** -0.5, use_triton=use_triton, out=out)
        assert got.shape == (len(layers), hkv, n) and not torch.isnan(out).any()
        for i, layer in enumerate(layers):
            want = window_votes(qs[layer], pool[layer, 0], pages, n, d ** -0.5, use_triton=use_triton)
            if use_triton:
                assert torch.equal(out[i], want)
            else:
                _close(out[i], want, (1e-5, 1e-6))
        assert not torch.allclose(out[0], window_votes(qs[2], pool[1, 0], pages, n, d ** -0.5, use_triton=False))


@pytest.mark.parametrize("dtype,group,page_size,n,w,d", [
    (torch.float32, 2, 4, 70, 8, 64), (torch.float16, 4, 16, 100, 32, 64), (torch.float32, 3, 8, 9, 9, 64),
    (torch.float32, 4, 8, 70, 16, WIDE), (torch.float16, 2, 16, 40, 8, WIDE)])
def test_window_votes_kernels_equal_the_reference(dtype, group, page_size, n, w, d):
    """SnapKV's window vote over paged keys: the Triton kernels equal the chunked torch reference, and both equal
    the observation-window definition (``policies.scoring.window_scores``) times the group size."""
    from agentrt_kernels.ops import window_votes
    from policies.scoring import window_scores

    _seed("votes", dtype, group, page_size, n, w, d)
    q, k, _, view = _setup([n], page_size, 2, group, d, dtype, [w])
    pages = view.block_tables[0, : -(-n // page_size)]
    got = window_votes(q, k, pages, n, d ** -0.5, use_triton=True)
    ref = window_votes(q, k, pages, n, d ** -0.5, use_triton=False)
    keys = k[pages.long()].flatten(0, 1)[:n]
    positions = torch.arange(n, device=DEVICE)
    definition = window_scores(q, keys, positions[n - w:], positions.expand(2, n)) * group
    _close(ref, definition, (1e-5, 1e-5))
    _close(got, ref, (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-3))


@pytest.mark.parametrize("dtype,group,page_size,budget,aggregate,d", [
    (torch.float32, 2, 4, 18, "max", 32), (torch.float16, 4, 8, 40, "sum", 32), (torch.float32, 1, 16, 16, "max", 32),
    (torch.float32, 2, 4, 18, "sum", WIDE)])
def test_quest_fused_decode_selection_equals_the_torch_ops(dtype, group, page_size, budget, aggregate, d):
    """A pure-decode step's Quest selection in two Triton launches (bounds update + scores, selected table)
    equals the torch ops it replaces: the same table, lengths and updated page bounds. Rows: shorter than
    the budget, a new key opening a page (bounds reset) and mid-page, rows of unequal widths."""
    from engine.registry import create_method

    _seed("quest-fused", dtype, group, page_size, d)
    hkv = 2
    kv_lens = [budget - 3, 5 * page_size + 1, 9 * page_size - 2, 13 * page_size + page_size // 2]
    q, k_cache, _, view = _setup(kv_lens, page_size, hkv, group, d, dtype)[:4]
    num_pages = k_cache.shape[0]
    kmin = torch.randn(num_pages, hkv, d, device=DEVICE).to(dtype)
    kmax = (kmin.float() + torch.rand(num_pages, hkv, d, device=DEVICE)).to(dtype)
    method = create_method("quest", {"token_budget": budget, "aggregate": aggregate})
    ref_min, ref_max = kmin.clone(), kmax.clone()
    want = method._select_decode(q, view, k_cache, ref_min, ref_max, fused=False)
    got = method._select_decode(q, view, k_cache, kmin, kmax, fused=True)
    assert torch.equal(got.block_tables, want.block_tables)
    assert torch.equal(got.kv_lens, want.kv_lens) and got.kv_lens_cpu == want.kv_lens_cpu
    assert got.kv_lens.tolist() == got.kv_lens_cpu
    assert torch.equal(kmin, ref_min) and torch.equal(kmax, ref_max)
    assert got.kv_lens_cpu[0] == kv_lens[0] and got.kv_lens_cpu[3] < kv_lens[3]  # short row: all, long: some


def test_quest_engine_decodes_the_same_through_the_fused_selection(tiny_dirs):
    """An engine run (GQA, mixed lengths, chunked prefill) with Quest's pure-decode steps selecting through
    the Triton launches gives the tokens of the torch-op selection, and selects the same pages every layer."""
    from engine import LLM, SamplingParams
    from policies.quest import Quest

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 33, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for fused in (False, True):
        llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=DEVICE, page_size=4, max_num_batched_tokens=32,
                  method="quest", method_config={"token_budget": 16, "dense_layers": 1}, num_pages=256,
                  enforce_eager=True)  # a decode graph's replay would bypass the wrapped selection
        method, tables = llm.engine.method, []
        inner = Quest._select_decode

        def select_decode(*a, fused=fused, inner=inner, method=method, tables=tables):
            out = inner(method, *a, fused=fused)
            tables.append((out.block_tables.tolist(), out.kv_lens.tolist()))
            return out

        method._select_decode = select_decode
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], tables))
    (ref_tokens, ref_tables), (tokens, tables) = runs
    assert tokens == ref_tokens
    assert tables == ref_tables and len(tables) >= 5


@pytest.mark.parametrize("method,cfg", [("pyramidkv", {"budget": 96, "window": 8}), ("kvzip", {"budget": 48})])
def test_triton_backend_over_per_layer_lengths_equals_torch_backend(method, cfg, tiny_dirs):
    """Eviction that leaves layers of different physical lengths, with chunked prefill mixing prompts and
    decodes: the Triton backend's tokens equal the torch backend's (each layer's lengths must reach the kernels
    as a contiguous row: a strided one would be read with the stride of the layer count)."""
    import random

    from engine import LLM, SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(48)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] if i % 2 == 0 else
               [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate([5, 300, 17, 64, 130, 33])]
    outs = []
    for triton_backend in (False, True):
        llm = LLM(tiny_dirs["llama"], device=str(DEVICE), dtype="float32", attention_backend="torch",
                  max_num_batched_tokens=64, enforce_eager=True, max_num_seqs=16, method=method, method_config=cfg,
                  enable_prefix_caching=False, num_pages=256)
        engine, uneven_steps = llm.engine, []
        if triton_backend:
            engine.backend = engine.runner.backend = TritonBackend()
        build = engine.cache.build_layer_views

        def recording(reqs, num_new_tokens, build=build):
            views = build(reqs, num_new_tokens)
            if views is not None and any(v.kv_lens_cpu != views[0].kv_lens_cpu for v in views):
                uneven_steps.append(len(reqs))
            return views

        engine.cache.build_layer_views = recording
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4,
                                                                                ignore_eos=True))])
        assert uneven_steps, "no step had layers of different lengths"
    assert outs[0] == outs[1]
