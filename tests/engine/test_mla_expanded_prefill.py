"""Latent (MLA) prompt chunks through expanded keys and values (engine.latent_expansion): the expanded attention
against attention written from its definition over the absorbed form, and engines that expand every prompt chunk
against transformers (greedy tokens, chunked prefill with prefix hits and mixed steps) and against the absorbed
engine (log-probabilities)."""

import pytest
import torch

from engine import SamplingParams
from engine.errors import ConfigError
from engine.latent_expansion import LatentExpansion, attend_split, latent_rows, requests_to_expand
from tests.engine.test_engine_vs_hf import PAGE, assert_all_pages_free, eos_ids, make_prompts
from tests.hf_reference import hf_greedy

ARCHS = ["deepseek_v3", "glm4_moe_lite"]
MAX_NEW = 6


def absorbed_reference(q_nope, q_pe, w_uk, w_uv, rows, scale, count):
    """The last ``count`` queries over ``rows`` [L, rank + rope] in the absorbed form, from its definition: the
    logit of head h is (W_UK[h]^T q_nope) . c + q_pe . k_pe, the output W_UV[h] sum_s p_s c_s; query j sees
    rows < L - count + j + 1."""
    rank = w_uk.shape[2]
    c, k_pe = rows[:, :rank], rows[:, rank:]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    logits = (torch.einsum("thr,lr->thl", q_latent, c) + torch.einsum("thd,ld->thl", q_pe, k_pe)) * scale
    length = rows.shape[0]
    visible = torch.arange(length)[None, :] < (length - count + torch.arange(count) + 1)[:, None]
    probs = logits.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("hvr,thr->thv", w_uv, torch.einsum("thl,lr->thr", probs, c))


def random_expansion(gen, t, heads=3, nope=8, rope=4, v=6, rank=10):
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return LatentExpansion(r(t, heads, nope), r(t, heads, rope), r(heads, nope, rank), r(heads, v, rank), 0.3)


def test_the_expanded_attention_equals_the_absorbed_form():
    gen = torch.Generator().manual_seed(0)
    exp = random_expansion(gen, t=7)
    rows = torch.randn(19, 10 + 4, generator=gen)  # 12 earlier rows, then the chunk's 7
    got = exp.attend(rows, 0, 7)
    want = absorbed_reference(exp.q_nope, exp.q_pe, exp.w_uk, exp.w_uv, rows, 0.3, 7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the absorb helper is the same W_UV product
    out = torch.randn(7, 3, 10, generator=gen)
    torch.testing.assert_close(exp.absorb(out), torch.einsum("hvr,thr->thv", exp.w_uv, out))


@pytest.mark.parametrize("block_rows", [1, 5, 12, 100])
@pytest.mark.parametrize("v", [6, 12])  # values narrower than the keys (written out), or as wide (flash attention)
def test_the_context_expanded_a_block_at_a_time_equals_the_absorbed_form(monkeypatch, block_rows, v):
    """The rows before the chunk expanded ``block_rows`` at a time (the byte budget set to that many rows), each
    block attended with its log-sum-exp and merged: the absorbed definition's output, whatever the cut."""
    import engine.latent_expansion as latent_expansion

    gen = torch.Generator().manual_seed(4)
    exp = random_expansion(gen, t=7, v=v)
    monkeypatch.setattr(latent_expansion, "MAX_EXPANDED_BYTES", block_rows * exp.bytes_per_row())
    rows = torch.randn(19, 10 + 4, generator=gen)
    torch.testing.assert_close(exp.attend(rows, 0, 7),
                               absorbed_reference(exp.q_nope, exp.q_pe, exp.w_uk, exp.w_uv, rows, 0.3, 7),
                               atol=1e-5, rtol=1e-5)
    # a chunk that is the whole context (no rows before it) and one of a single token
    torch.testing.assert_close(exp.attend(rows[:7], 0, 7),
                               absorbed_reference(exp.q_nope, exp.q_pe, exp.w_uk, exp.w_uv, rows[:7], 0.3, 7),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exp.attend(rows, 6, 1),
                               absorbed_reference(exp.q_nope[6:], exp.q_pe[6:], exp.w_uk, exp.w_uv, rows, 0.3, 1),
                               atol=1e-5, rtol=1e-5)


def test_a_step_is_split_into_expanded_requests_and_absorbed_runs():
    """Three requests over one paged latent cache (pages shuffled): a 5-token chunk over 9 rows (expanded), a
    decode row and a 4-token chunk (absorbed together, through the callback on their sub-view)."""
    from engine.contract.view import PagedView

    gen = torch.Generator().manual_seed(1)
    page, width, rank = 4, 14, 10
    cache = torch.randn(12, page, 1, width, generator=gen)
    tables = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0], [3, 11, 6, 0]], dtype=torch.int32)
    kv, ql = [9, 6, 10], [5, 1, 4]
    exp = random_expansion(gen, t=sum(ql))
    view = PagedView(tables, torch.tensor(kv, dtype=torch.int32), torch.tensor([0, 5, 6, 10], dtype=torch.int32),
                     page, kv, ql)
    seen = []

    def absorbed(q_rows, sub):  # the absorbed form of each request of the sub-view, from the definition
        seen.append(sub.kv_lens_cpu)
        outs, row = [], 0
        for i, n in enumerate(sub.query_lens_cpu):
            rows = latent_rows(cache, sub.block_tables[i], sub.kv_lens_cpu[i])
            q = q_rows[row:row + n]
            probs = absorbed_probs(q, rows, n)
            outs.append(torch.einsum("thl,lr->thr", probs, rows[:, :rank]))
            row += n
        return torch.cat(outs)

    def absorbed_probs(q, rows, n):
        length = rows.shape[0]
        logits = torch.einsum("thw,lw->thl", q, rows) * 0.3
        visible = torch.arange(length)[None, :] < (length - n + torch.arange(n) + 1)[:, None]
        return logits.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)

    q_abs = torch.cat([torch.einsum("thn,hnr->thr", exp.q_nope, exp.w_uk), exp.q_pe], dim=-1)
    got = attend_split(q_abs, view, cache, [True, False, False], exp, absorbed)
    assert seen == [[6, 10]]
    starts = [0, 5, 6, 10]
    for i in range(3):
        rows = latent_rows(cache, tables[i], kv[i])
        want = absorbed_reference(exp.q_nope[starts[i]:starts[i + 1]], exp.q_pe[starts[i]:starts[i + 1]], exp.w_uk,
                                  exp.w_uv, rows, 0.3, ql[i])
        torch.testing.assert_close(got[starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_which_chunks_expand():
    gen = torch.Generator().manual_seed(2)
    # GLM-4.7-Flash's sizes: nope 192, rope 64, v 256, kv_lora_rank 512; DeepSeek-V3's: nope 128, v 128
    bf16 = dict(dtype=torch.bfloat16)
    glm = LatentExpansion(torch.zeros(1, 2, 192, **bf16), torch.zeros(1, 2, 64, **bf16),
                          torch.zeros(2, 192, 512, **bf16), torch.zeros(2, 256, 512, **bf16), 1.0)
    ds = LatentExpansion(torch.zeros(1, 2, 128, **bf16), torch.zeros(1, 2, 64, **bf16),
                         torch.zeros(2, 128, 512, **bf16), torch.zeros(2, 128, 512, **bf16), 1.0)
    assert glm.crossover_query_len() == 399 and ds.crossover_query_len() == 171
    assert requests_to_expand("auto", glm, [1, 500, 300], on_gpu=True) == [False, True, False]
    assert requests_to_expand("auto", glm, [500], on_gpu=False) == [False]
    assert requests_to_expand("expanded", glm, [1, 2, 500], on_gpu=False) == [False, True, True]
    assert requests_to_expand("absorbed", glm, [500], on_gpu=True) == [False]
    # a shape whose keys and values differ in size (flash attention does not run it) or an fp32 model stays
    # absorbed under auto (a long context expands a block at a time: it no longer decides)
    assert requests_to_expand("auto", ds, [500], on_gpu=True) == [False]
    assert requests_to_expand("expanded", ds, [500], on_gpu=True) == [True]
    glm32 = LatentExpansion(*(t.float() for t in (glm.q_nope, glm.q_pe, glm.w_uk, glm.w_uv)), 1.0)
    assert requests_to_expand("auto", glm32, [500], on_gpu=True) == [False]
    del gen


def test_an_unknown_mode_is_refused_naming_the_field(mla_dirs):
    from engine.config import EngineConfig

    with pytest.raises(ConfigError, match="mla_prefill"):
        EngineConfig(mla_dirs["glm4_moe_lite"], mla_prefill="sometimes")


@pytest.mark.parametrize("arch", ARCHS)
def test_engines_expanding_every_prompt_chunk_match_transformers_and_the_absorbed_engine(
        arch, tiny_dirs, make_llm, monkeypatch):
    expanded_calls = []
    attend = LatentExpansion.attend
    monkeypatch.setattr(LatentExpansion, "attend",
                        lambda self, rows, first, count: expanded_calls.append(count) or attend(self, rows, first,
                                                                                                count))
    model_dir = tiny_dirs[arch]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=True)
    outputs = {}
    for mode in ("absorbed", "expanded"):
        llm = make_llm(arch, page_size=PAGE, max_num_batched_tokens=32, mla_prefill=mode)
        system, prompts = make_prompts(llm.engine.model_config.vocab_size, seed=11)
        prompts = prompts[:5]
        llm.generate([system + [5]], params)  # the shared system prompt: later chunks start past a prefix hit
        expanded_calls.clear()
        outputs[mode] = llm.generate(prompts, params)
        assert (len(expanded_calls) > 0) == (mode == "expanded")
        assert all(n > 1 for n in expanded_calls)  # decode rows never expand
        assert_all_pages_free(llm)
    for prompt, exp, ab in zip(prompts, outputs["expanded"], outputs["absorbed"]):
        assert exp.token_ids == hf_greedy(model_dir, prompt, MAX_NEW, eos_ids(llm)), f"prompt of {len(prompt)}"
        assert exp.token_ids == ab.token_ids
        assert max(abs(a - b) for a, b in zip(exp.logprobs, ab.logprobs)) < 1e-4
        if prompt[: len(system)] == system:
            assert exp.num_cached_tokens >= (len(system) // PAGE) * PAGE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused SDPA kernels need a GPU")
def test_on_a_gpu_the_expanded_attention_at_glm_sizes_equals_the_absorbed_form(monkeypatch):
    """GLM-4.7-Flash's head sizes in bf16 (flash attention over the earlier rows, then causal over the chunk's own)
    against the absorbed definition in fp32: a 512-token chunk over 2048 rows, the earlier rows in one block and in
    blocks of 500."""
    import engine.latent_expansion as latent_expansion

    gen = torch.Generator().manual_seed(3)
    heads, nope, rope, v, rank, t, length = 20, 192, 64, 256, 512, 512, 2048
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s)  # noqa: E731
    parts = [r(t, heads, nope), r(t, heads, rope), r(heads, nope, rank, s=rank**-0.5), r(heads, v, rank, s=rank**-0.5)]
    rows = r(length, rank + rope)
    exp = LatentExpansion(*(p.cuda().bfloat16() for p in parts), (nope + rope) ** -0.5)
    assert exp.fused_on_gpu()
    want = absorbed_reference(*parts, rows, (nope + rope) ** -0.5, t)
    got = exp.attend(rows.cuda().bfloat16(), 0, t).float().cpu()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
    monkeypatch.setattr(latent_expansion, "MAX_EXPANDED_BYTES", 500 * exp.bytes_per_row())
    got = exp.attend(rows.cuda().bfloat16(), 0, t).float().cpu()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
