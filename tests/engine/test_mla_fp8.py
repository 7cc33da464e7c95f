"""E4M3 latent rows (``kv_storage="fp8"`` on DeepSeek-V3 / GLM-4.7-Flash): each token's one latent row per layer
coded once, values read as the decoded row's first ``kv_lora_rank`` channels.

References, none taken from the code under test: the pool's bytes from the storage's own tensors; an E4M3 round
trip written here from the definition (one scale for the latent channels, one for the rotary ones, each the part's
absolute max / 448) of the rows an uncoded latent engine writes; the uncoded engine's log-probabilities; the
chain-eviction replay of tests/chain_eviction_reference.py (a dense full-matrix forward rebuilt from scratch
at every step under the kept sets, SnapKV's vote from its definition) with its attention reading round-tripped
rows; and fresh engines for prefix hits, chain turns, forks and rewinds. The chain tiers' byte-identical reload is
a case of tests/engine/test_chain_tiers.py."""

import logging
import random

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from tests.chain_helpers import random_tokens, run_chain_turn
from tests.codec_reference import EVICTION_CONFIGS

ARCHS = ["deepseek_v3", "glm4_moe_lite"]
LATENT, ROPE = 32, 8  # the tiny checkpoints' kv_lora_rank and qk_rope_head_dim (tests/conftest.py)
E4M3_MAX = 448.0


def e4m3_part(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest E4M3 of x / scale, scale = amax / 448 over the last dimension, times scale."""
    scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """A latent row's round trip: its latent and its rotary channels each under a scale of their own."""
    x = x.float()
    return torch.cat([e4m3_part(x[..., :LATENT]), e4m3_part(x[..., LATENT:])], -1)


def e4m3_bound(x: torch.Tensor) -> torch.Tensor:
    """E4M3's rounding bound per element: 2^-4 relative in the normal range, 2^-10 of the part's scale below."""
    x = x.float()
    scales = [x[..., s].abs().amax(-1, keepdim=True) / E4M3_MAX for s in (slice(0, LATENT), slice(LATENT, None))]
    scale = torch.cat([scales[0].expand(*x.shape[:-1], LATENT), scales[1].expand(*x.shape[:-1], ROPE)], -1)
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


def make_llm(model_dir, storage="fp8", dtype="float32", **kw):
    kw.setdefault("num_pages", 128)
    kw.setdefault("page_size", 8)
    return LLM(model_dir, dtype=dtype, device="cpu", max_num_batched_tokens=32, kv_storage=storage, **kw)


def prompt_of(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tensors_under(obj, seen=None):
    """Every tensor an object's attributes reach (through dicts, lists and tuples)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_under(v, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_under(v, seen)]
    return []


# --- (1) the pool holds the coded row once ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_holds_one_coded_row_per_token_and_layer(arch, dtype, mla_dirs):
    budget = 2**20
    coded = make_llm(mla_dirs[arch], dtype=dtype, num_pages=None, page_size=16, kv_cache_memory_bytes=budget)
    dense = make_llm(mla_dirs[arch], None, dtype=dtype, num_pages=None, page_size=16, kv_cache_memory_bytes=budget)
    storage = coded.engine.cache.storage
    pages = coded.engine.pool.num_pages + 1  # the pool's pages and the scratch page
    tensors = storage.page_tensors()
    # [layers, pages, page_size, one row, width]: E4M3 codes of the whole row, an fp32 scale for its latent
    # channels and one for its rotary channels; nothing else
    assert sorted((tuple(t.shape), t.dtype, dim) for t, dim in tensors) == sorted([
        ((2, pages, 16, 1, LATENT + ROPE), torch.uint8, 1), ((2, pages, 16, 1, 1), torch.float32, 1),
        ((2, pages, 16, 1, 1), torch.float32, 1)])
    owned = {t.untyped_storage().data_ptr() for t, _ in tensors}
    assert all(t.untyped_storage().data_ptr() in owned for t in tensors_under(vars(storage)))  # no values copy
    per_token_layer = sum(t.numel() * t.element_size() for t, _ in tensors) // (2 * pages * 16)
    assert per_token_layer == LATENT + ROPE + 8  # 48 bytes against 40 x 4 (fp32) / 40 x 2 (bf16) uncoded
    assert coded.engine.cache.spec.bytes_per_token == 2 * per_token_layer  # what pool sizing and admission read
    assert coded.engine.pool.num_pages == budget // (16 * 2 * per_token_layer)
    dense_rows = dense.engine.cache.storage.rows
    dense_per_token_layer = dense_rows.element_size() * dense_rows.shape[-1]
    assert dense.engine.pool.num_pages == budget // (16 * 2 * dense_per_token_layer)
    assert coded.engine.pool.num_pages > dense.engine.pool.num_pages
    # values: the decoded row's first kv_lora_rank channels
    out = coded.generate([prompt_of(40)], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(out.token_ids) == 3
    keys, values = storage.layer_kv(1)
    assert keys.shape[-1] == LATENT + ROPE and values.shape[-1] == LATENT
    slots = torch.arange(40)
    assert torch.equal(values.flatten(0, 1)[slots], keys.flatten(0, 1)[slots][..., :LATENT])


# --- (2) decoded rows are the E4M3 round trip of the uncoded engine's rows ---------------------------------
def prefill_rows(llm, prompt, capture=None):
    """Prefill ``prompt`` in one step; per layer, the rows its slots hold (decoded under a codec)."""
    eng = llm.engine
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    req = eng._requests[rid]
    eng.step()
    ps = eng.cache.page_size
    pages = torch.tensor(eng.cache.table(req).pages)
    slots = pages[torch.arange(len(prompt)) // ps] * ps + torch.arange(len(prompt)) % ps
    rows = [eng.cache.layer_kv(layer)[0].flatten(0, 1)[slots][:, 0].float() for layer in range(2)]
    eng.abort(rid)
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_decoded_rows_are_the_e4m3_round_trip_of_the_rows_an_uncoded_engine_writes(arch, mla_dirs):
    prompt = prompt_of(30, seed=1)
    dense = prefill_rows(make_llm(mla_dirs[arch], None), prompt)
    llm = make_llm(mla_dirs[arch])
    handed = {}
    storage = llm.engine.cache.storage
    inner = storage.write

    def write(layer, k, v, slots, positions=None):  # the rows the model hands the coded storage
        handed[layer] = k[:, 0].float().clone()
        inner(layer, k, v, slots, positions)

    storage.write = write
    coded = prefill_rows(llm, prompt)
    # layer 0's rows come before any attention: the same rows as the uncoded engine's, coded
    assert torch.equal(handed[0], dense[0])
    torch.testing.assert_close(coded[0], e4m3_rows(dense[0]), rtol=0, atol=0)
    assert ((coded[0] - dense[0]).abs() <= e4m3_bound(dense[0])).all()
    # every layer stores the round trip of what it is handed (layer 1's rows read coded layer-0 rows)
    for layer in range(2):
        torch.testing.assert_close(coded[layer], e4m3_rows(handed[layer]), rtol=0, atol=0)
        assert ((coded[layer] - handed[layer]).abs() <= e4m3_bound(handed[layer])).all()


# --- (3) log-probabilities and greedy tokens against the uncoded latent engine ------------------------------
# max |logprob - uncoded| over 30 forced tokens after a 60-token prompt, fp32, page size 8, chunks of 32.
# Measured: deepseek_v3 0.076, glm4_moe_lite 0.030; the stated tolerance is about twice the larger.
LOGPROB_TOLERANCE = 0.15
# Along the uncoded engine's 32 greedy tokens (teacher-forced into both), the coded engine's top token differed at
# 2 (deepseek_v3) and 3 (glm4_moe_lite) steps, all where the uncoded top led the runner-up by at most 0.054, and
# there the uncoded token trailed the coded top by at most 0.036.
CLEAR_MARGIN = 0.1


def forced(llm, prompt, tokens):
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(tokens), forced_token_ids=tokens,
                                                logprobs=True, top_logprobs=2, ignore_eos=True))[0]
    assert out.token_ids == tokens
    return torch.tensor(out.logprobs), out.top_logprobs


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_greedy_choices_stay_close_to_the_uncoded_latent_engine(arch, mla_dirs):
    prompt = prompt_of(60)
    dense_llm, coded_llm = make_llm(mla_dirs[arch], None), make_llm(mla_dirs[arch])
    dense_lp, _ = forced(dense_llm, prompt, prompt_of(30, seed=5))
    coded_lp, _ = forced(coded_llm, prompt, prompt_of(30, seed=5))
    err = (coded_lp - dense_lp).abs().max().item()
    print(f"{arch}: max |d logprob| = {err:.4f}")
    assert err < LOGPROB_TOLERANCE
    greedy = dense_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
    _, dense_top = forced(dense_llm, prompt, greedy.token_ids)
    lp, coded_top = forced(coded_llm, prompt, greedy.token_ids)
    assert [top[0][0] for top in dense_top] == greedy.token_ids
    same = [top[0][0] == t for top, t in zip(coded_top, greedy.token_ids)]
    assert sum(same) >= 28
    for i, agrees in enumerate(same):
        if not agrees:  # only a near tie of the uncoded engine flips, and only to a near tie
            assert dense_top[i][0][1] - dense_top[i][1][1] < CLEAR_MARGIN
            assert coded_top[i][0][1] - lp[i].item() < CLEAR_MARGIN


# --- (4) a SnapKV chain over coded rows against the replay rebuilt from scratch -----------------------------
SNAP = dict(budget=24, window=6, kernel_size=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_snapkv_chain_on_coded_rows_resumes_and_equals_the_replay_from_scratch(arch, mla_dirs, monkeypatch):
    import tests.eviction_reference as eviction
    from tests.chain_eviction_reference import MAX_NEW, PARAMS, make_rule, record_steps, simulate_chain

    class CodedRowsRunner(eviction.RecordingRunner):
        """The replay's attention over round-tripped rows: keys the coded row, values its latent channels."""

        def attention(self, layer, q, k, v):
            rows = e4m3_rows(k).to(k.dtype)
            return super().attention(layer, q, rows, rows[..., : v.shape[-1]])

    monkeypatch.setattr(eviction, "RecordingRunner", CodedRowsRunner)
    llm = eviction.make_llm(mla_dirs[arch], "snapkv", SNAP, chunk=16, kv_storage="fp8")
    eng = llm.engine
    steps = record_steps(eng)
    rng = random.Random(7)
    history, turns = [], []
    for t, k in enumerate((40, 20)):
        new = random_tokens(rng, k)
        prompt = history + new
        first = len(steps)
        out = run_chain_turn(eng, "c", prompt, PARAMS)
        if t:  # resumed: only the new tokens and the last turn's final token (it had no KV) are prefilled
            assert out.resume_status == "resumed"
            assert out.num_prefilled_tokens == len(new) + 1 and out.num_resumed_tokens == len(history) - 1
        assert len(prompt) > SNAP["budget"] and len(out.token_ids) == MAX_NEW
        turns.append((prompt, new, [n for _, n, _ in steps[first:]], out))
        history = prompt + out.token_ids
    assert eng.chain_info("c").compacted
    assert eng.cache.spec.bytes_per_token == 2 * (LATENT + ROPE + 8)
    rule = make_rule("snapkv", SNAP, 2)
    ref_tokens, ref_kept, _ = simulate_chain(
        eng.model, [(new, n, len(prompt) - out.num_prefilled_tokens) for prompt, new, n, out in turns], rule, 2, 1)
    assert len(ref_kept) == len(steps)
    for i, ((_, _, got), want) in enumerate(zip(steps, ref_kept)):
        for layer, (g, w) in enumerate(zip(got, want)):
            assert g.tolist() == w, f"step {i}, layer {layer}"
    assert [out.token_ids for *_, out in turns] == ref_tokens
    eng.delete_chain("c")
    eng.clear_prefix_cache()
    assert eng.pool.num_free == eng.pool.num_pages


# --- compaction and every eviction method -------------------------------------------------------------------
def test_compaction_moves_coded_rows_exactly_and_attention_reads_their_latent_channels_as_values(mla_dirs):
    """Compact a coded request to a subset of its slots, append a row, attend: the kept slots hold the very codes
    and scales stored before (moved, not re-encoded), and the torch reference's output is dense attention over the
    decoded rows with their first kv_lora_rank channels as values."""
    from engine.attention_backend import quantized_forward
    from engine.page_table import physical_slots

    eng = make_llm(mla_dirs["deepseek_v3"]).engine
    cache, storage = eng.cache, eng.cache.storage
    req = eng._requests[eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=4))]
    n, m, width = 50, 29, LATENT + ROPE
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 1, width, generator=g) * torch.cat([torch.ones(LATENT), 40 * torch.ones(ROPE)])
            for _ in range(2)]
    assert cache.allocate(req, n)
    for layer, k in enumerate(rows):
        cache.write_prefix(req, layer, k, k[..., :LATENT])
    cache.commit(req, n)
    slots = physical_slots(cache.table(req).pages, 0, n, cache.page_size, cache.spec.device)
    fields = [{name: t[layer].flatten(0, 1)[slots].clone() for name, t in storage.fields.items()} for layer in range(2)]
    for layer, k in enumerate(rows):  # what was stored is the round trip, the rotary part under its own scale
        torch.testing.assert_close(cache.layer_kv(layer)[0].flatten(0, 1)[slots].float(), e4m3_rows(k),
                                   rtol=0, atol=0)
    keep = [torch.randperm(n, generator=g)[:m].sort().values[None] for _ in range(2)]
    assert cache.compact(req, keep) and cache.physical_len(req, 1) == m
    kept_slots = physical_slots(cache.table(req).pages, 0, m, cache.page_size, cache.spec.device)
    for layer in range(2):
        for name, t in storage.fields.items():
            assert torch.equal(t[layer].flatten(0, 1)[kept_slots], fields[layer][name][keep[layer][0]])
    assert cache.allocate(req, 1)
    sm = cache.slot_mapping([req], [1])
    views = cache.build_layer_views([req], [1])
    for layer, k in enumerate(rows):
        new = torch.randn(1, 1, width, generator=g)
        cache.write(layer, new, new[..., :LATENT], sm)
        q = torch.randn(1, 4, width, generator=g)
        got, _ = quantized_forward(q, views[layer], width**-0.5)
        keys = torch.cat([e4m3_rows(k)[keep[layer][0]], e4m3_rows(new)])[:, 0]  # [m + 1, width]
        probs = torch.softmax(torch.einsum("qhd,kd->hqk", q, keys) * width**-0.5, -1)
        want = torch.einsum("hqk,kd->qhd", probs, keys[:, :LATENT])
        assert got.shape == (1, 4, LATENT)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache.commit(req, 1)
    eng.abort(req.request_id)
    assert all(r == 0 for r in eng.pool.ref_counts)


EVICTION = EVICTION_CONFIGS


@pytest.mark.parametrize("method", list(EVICTION))
def test_every_eviction_method_holds_the_slots_it_holds_on_uncoded_rows(method, mla_dirs):
    """Through the same contract: each layer ends every step holding as many slots as the method holds on the
    uncoded latent cache (budgets fix the counts), and every page comes back."""
    arch = ARCHS[len(method) % 2]
    lens = {}
    for storage in (None, "fp8"):
        llm = make_llm(mla_dirs[arch], storage, page_size=4, num_pages=256, method=method,
                       method_config=EVICTION[method])
        eng = llm.engine
        seen = lens.setdefault(storage, [])
        inner = eng.method.end_step

        def end_step(batch, inner=inner, eng=eng, seen=seen):
            inner(batch)
            seen.append([(r.num_computed_tokens, [eng.cache.physical_len(r, layer) for layer in range(2)])
                         for r in batch.requests])

        eng.method.end_step = end_step
        outs = llm.generate([prompt_of(50), prompt_of(33, seed=1)],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert all(len(o.token_ids) == 12 for o in outs)
        assert all(r == 0 for r in eng.pool.ref_counts)
    assert lens[None] == lens["fp8"]
    assert any(max(held) < computed for step in lens["fp8"] for computed, held in step)  # something was evicted


# --- prefix hits, chain turns, forks and rewinds equal fresh runs -----------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_chain_turns_forks_and_rewinds_equal_fresh_coded_runs(arch, mla_dirs):
    """Token-local codes do not depend on the schedule: a prefix hit, a resumed turn, a fork and a rewound chain
    give the tokens and log-probabilities of a fresh coded run on the whole history."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    fresh = make_llm(mla_dirs[arch], enable_prefix_caching=False)

    def ref(p):
        return fresh.generate([p], params)[0]

    def same(out, want):
        assert out.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)

    llm = make_llm(mla_dirs[arch])
    eng = llm.engine
    p1 = prompt_of(37, seed=2)
    first = llm.generate([p1], params)[0]
    again = llm.generate([p1], params)[0]
    assert again.num_cached_tokens == 32
    same(first, ref(p1))
    same(again, ref(p1))
    h = p1 + run_chain_turn(eng, "c", p1, params).token_ids
    eng.fork_chain("c", "d")
    histories = {}
    for cid, extra in (("c", [5, 6, 7]), ("d", [9] * 11)):
        out = run_chain_turn(eng, cid, h + extra, params)
        assert out.resume_status == "resumed"
        same(out, ref(h + extra))
        histories[cid] = h + extra + out.token_ids
    eng.rewind_chain("c", 30)
    out = run_chain_turn(eng, "c", h[:30] + [11, 12], params)
    assert out.resume_status == "resumed" and out.num_prefilled_tokens == 2
    same(out, ref(h[:30] + [11, 12]))
    pruned = eng.prune_chain("d", [(4, 28)], scorer="knorm", keep_ratio=0.5)
    assert pruned.status == "applied" and eng.chain_info("d").compacted
    out = run_chain_turn(eng, "d", histories["d"] + [3, 4], params)  # resumes the pruned, compacted rows
    assert out.resume_status == "resumed" and out.num_prefilled_tokens == 3  # the last output token, 2 new
    for cid in ("c", "d"):
        eng.delete_chain(cid)
    eng.clear_prefix_cache()
    assert eng.pool.num_free == eng.pool.num_pages


def test_decode_windows_over_coded_rows_equal_single_steps(mla_dirs):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)
    prompts = [prompt_of(23), prompt_of(41, seed=1)]
    single = make_llm(mla_dirs["deepseek_v3"]).generate(prompts, params)
    windowed = make_llm(mla_dirs["deepseek_v3"], decode_steps=4).generate(prompts, params)
    assert [o.token_ids for o in windowed] == [o.token_ids for o in single]
    assert [o.logprobs for o in windowed] == [o.logprobs for o in single]


def test_tensor_parallel_ranks_hold_the_coded_rows_whole_and_agree_with_one_rank(mla_dirs):
    """Two gloo ranks, two query heads each, every rank holding the whole coded latent cache: SnapKV over coded
    rows keeps the same slots and the tokens equal the single rank's."""
    from tests.engine.test_tensor_parallel import (PROMPTS, assert_gone, assert_same_greedy, engine, generate,
                                                   kept_positions, worker_procs)

    options = dict(kv_storage="fp8", method="snapkv", method_config={"budget": 12, "window": 4})
    ref, ref_kept = generate(engine(mla_dirs["glm4_moe_lite"], 1, **options), PROMPTS, kept_positions)
    with engine(mla_dirs["glm4_moe_lite"], 2, **options) as eng:
        procs = worker_procs(eng)
        assert type(eng.cache.storage).__name__ == "CodedLatentKV" and eng.cache.spec.num_kv_heads == 1
        got, kept = generate(eng, PROMPTS, kept_positions)
    assert_gone(procs)
    assert_same_greedy(ref, got)
    for ref_layers, layers in zip(ref_kept, kept):
        assert all(torch.equal(g, r) for r, g in zip(ref_layers, layers))
    assert ref_kept[2][0].shape == (1, 12)  # the 41-token prompt was cut to the budget


# --- (5) what is refused, by name ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,why", [
    ("kivi", "keys are quantized per channel over groups of tokens"),
    ("turboquant", "rotates and normalizes each vector whole"),
    ("palu", "per-head key and value projections"),
])
def test_codecs_that_cannot_code_a_row_once_are_refused_naming_the_field(name, why, mla_dirs):
    with pytest.raises(ConfigError) as exc:
        LLMEngine(EngineConfig(mla_dirs["deepseek_v3"], dtype="float32", device="cpu", kv_storage=name))
    assert f"kv_storage {name!r} cannot code latent (MLA) rows: " in str(exc.value) and why in str(exc.value)


def test_the_triton_backend_reads_e4m3_rows_and_refuses_a_row_format_it_has_no_kernel_for(mla_dirs, monkeypatch,
                                                                                           caplog):
    pytest.importorskip("triton")
    import engine.attention_backend as ab
    from engine.contract.method import SparseMethod
    from engine.gpu_backends import TritonBackend
    from engine.registry import create_kv_storage
    from policies.fp8_kv import E4M3LatentRow

    codec = create_kv_storage("fp8")
    triton = TritonBackend.__new__(TritonBackend)  # its reasons are class-level: no kernels are loaded
    assert triton.unsupported(SparseMethod(), torch.bfloat16, codec, head_dim=576, value_dim=512) == []
    assert triton.unsupported(SparseMethod(), torch.bfloat16, None, head_dim=576, value_dim=512) == []
    assert triton.unsupported(SparseMethod(), torch.bfloat16, codec, head_dim=128) == []  # dense heads: its kernel
    # a latent row format no kernel reads: refused naming the codec; auto on a GPU takes torch after Triton
    monkeypatch.setattr(E4M3LatentRow, "kernel_format", None)
    (reason,) = triton.unsupported(SparseMethod(), torch.bfloat16, codec, head_dim=576, value_dim=512)
    assert reason == ("the triton backend has no kernel for latent (MLA) rows coded by kv_storage 'fp8'; "
                      "attention_backend 'torch' reads them")
    assert ab.TorchReferenceBackend().unsupported(SparseMethod(), torch.bfloat16, codec, 576, 512) == []
    monkeypatch.setattr(ab, "auto_candidates", lambda device, flashinfer: ["triton", "torch"])
    real = ab._construct
    monkeypatch.setattr(ab, "_construct", lambda name, device: triton if name == "triton" else real(name, device))
    with caplog.at_level(logging.INFO, logger="engine.attention_backend"):
        backend = ab.make_backend("auto", torch.device("cpu"), SparseMethod(), torch.bfloat16, codec, 576, 512)
    assert backend.name == "torch"
    assert f"attention backend auto: not triton ({reason})" in caplog.messages
    with pytest.raises(ConfigError, match="cannot run on attention_backend 'triton'.*kv_storage 'fp8'"):
        monkeypatch.setattr(ab, "_construct", lambda name, device: triton)
        ab.make_backend("triton", torch.device("cpu"), SparseMethod(), torch.bfloat16, codec, 576, 512)


def test_an_engine_on_coded_rows_on_the_cpu_serves_the_torch_backend(mla_dirs):
    llm = make_llm(mla_dirs["glm4_moe_lite"])
    assert llm.engine.backend.name == "torch"
    assert type(llm.engine.cache.storage).__name__ == "CodedLatentKV"
    assert llm.engine.cache.storage.codec is llm.engine.codec
