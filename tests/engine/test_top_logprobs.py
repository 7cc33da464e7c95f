"""Top logprobs (``SamplingParams.top_logprobs``): per generated token, the K most likely tokens of the model's
raw distribution, most likely first.

References: a dense ``torch.log_softmax(logits).topk`` for the sampler; HF transformers' logits of the prompt
plus the generated tokens for the engine (tests/hf_reference.py); the engine with ``decode_steps=1`` for
decode windows, serial and overlapped.
"""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidSamplingParamsError
from engine.sampler import Sampler, make_generator
from tests.hf_reference import hf_model


def rand_logits(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3.0


def assert_top_equal(got, ref_logp, k, atol):
    """``got``, one step's top list, against the dense reference row ``ref_logp`` [V]: the K best values in
    descending order, and each listed token's own logprob (so near-ties may swap, nothing else may)."""
    ref_vals, ref_ids = ref_logp.topk(min(k, ref_logp.numel()))
    assert len(got) == len(ref_ids)
    ids = [t for t, _ in got]
    vals = [v for _, v in got]
    assert all(isinstance(t, int) for t in ids) and len(set(ids)) == len(ids)
    assert vals == sorted(vals, reverse=True)
    torch.testing.assert_close(torch.tensor(vals), ref_vals, rtol=0, atol=atol)
    torch.testing.assert_close(ref_logp[torch.tensor(ids)], torch.tensor(vals), rtol=0, atol=atol)
    for j, (t, r) in enumerate(zip(ids, ref_ids.tolist())):
        if t != r:  # only a near-tie may swap places
            assert abs(ref_logp[t] - ref_logp[r]) < 2 * atol, (j, t, r)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3", None])
def test_bad_top_logprobs_raise(value):
    with pytest.raises(InvalidSamplingParamsError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=value)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidSamplingParamsError, match="top_logprobs.*logprobs=True"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(top_logprobs=0).top_logprobs == 0
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20


# ---------------------------------------------------------------- sampler


def test_sampler_mixed_rows_match_dense_topk():
    vocab = 300
    logits = rand_logits(9, vocab, seed=11)
    forced_token = int(logits[4].argmin())  # the least likely token: never in the top list
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.7, top_k=3, seed=2, logprobs=True, top_logprobs=20),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=True),  # logprobs without the top list
        SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3),  # forced below
        SamplingParams(temperature=1.3, top_p=0.5, logprobs=True, top_logprobs=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, min_p=0.05, logprobs=True, top_logprobs=7),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
    ]
    gens = [make_generator(p.seed, "cpu") for p in params]
    forced = [None] * 9
    forced[4] = forced_token
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    out = Sampler().sample(logits, params, gens, forced)
    assert len(out.top_logprobs) == len(params)
    for i, p in enumerate(params):
        top = out.top_logprobs[i]
        if not p.top_logprobs:
            assert top is None, i
            continue
        assert_top_equal(top, ref[i], p.top_logprobs, atol=1e-5)
        assert len(top) == p.top_logprobs
        if p.is_greedy:
            assert top[0] == (out.token_ids[i], out.logprobs[i])
    assert out.token_ids[4] == forced_token
    assert forced_token not in [t for t, _ in out.top_logprobs[4]]
    assert out.logprobs[4] == pytest.approx(ref[4, forced_token].item(), abs=1e-5)

    tokens, logprobs, top = Sampler().sample_tensors(logits, params, gens, forced)
    values, ids = top
    assert values.shape == ids.shape == (6, 20)  # the asking rows only, as wide as the largest K


def test_sampler_same_k_everywhere_and_small_vocab():
    logits = rand_logits(4, 12, seed=3)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20)] * 4
    out = Sampler().sample(logits, params, [None] * 4)
    ref = torch.log_softmax(logits, dim=-1)
    for i in range(4):
        assert len(out.top_logprobs[i]) == 12  # the whole vocabulary, sorted
        assert_top_equal(out.top_logprobs[i], ref[i], 20, atol=1e-6)
        assert out.top_logprobs[i][0] == (out.token_ids[i], out.logprobs[i])


def test_sampler_without_top_logprobs_returns_none():
    logits = rand_logits(3, 50, seed=4)
    for lp in (False, True):
        params = [SamplingParams(temperature=0.0, logprobs=lp), SamplingParams(temperature=1.0, logprobs=lp)]
        out = Sampler().sample(logits[:2], params, [None, None])
        assert out.top_logprobs == [None, None]
        assert Sampler().sample_tensors(logits[:2], params, [None, None])[2] is None


# ---------------------------------------------------------------- engine vs HF


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm("llama", max_model_len=512, num_pages=48)


def hf_log_softmax(model_dir, prompt_ids, output_ids):
    """HF's log_softmax at each generated position: row i is the distribution token i was drawn from."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    n = len(prompt_ids)
    return torch.log_softmax(logits, dim=-1)[n - 1:n - 1 + len(output_ids)]


def test_engine_top_logprobs_match_hf(llm, tiny_dirs):
    prompts = [[40, 41, 42, 43, 44], [7, 300, 21, 9, 88, 150, 3], [60, 61, 62] * 4, [99, 100]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3,
                       forced_token_ids=[9, 300]),
        SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True),  # asks for nothing
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True),  # no top list
    ]
    outs = llm.generate(prompts, params)
    assert outs[2].logprobs is None and outs[2].top_logprobs is None
    assert outs[3].logprobs is not None and outs[3].top_logprobs is None
    assert outs[1].token_ids[:2] == [9, 300]
    for prompt, p, out in zip(prompts[:2], params[:2], outs[:2]):
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs) == p.max_tokens
        ref = hf_log_softmax(tiny_dirs["llama"], prompt, out.token_ids)
        for i, top in enumerate(out.top_logprobs):
            assert_top_equal(top, ref[i], p.top_logprobs, atol=1e-4)
            assert len(top) == p.top_logprobs
            if p.is_greedy:
                assert top[0] == (out.token_ids[i], out.logprobs[i])


def test_streamed_top_logprobs_grow_with_the_tokens(llm):
    engine = llm.engine
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                         logprobs=True, top_logprobs=4))
    seen = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            assert len(o.top_logprobs) == len(o.token_ids) == len(o.logprobs)
            seen.append(o)
    assert seen[-1].finished
    for o in seen:  # each output's list is a prefix of the final one
        assert o.top_logprobs == seen[-1].top_logprobs[:len(o.top_logprobs)]


# ---------------------------------------------------------------- decode windows


def run_engine(model_dir, items, **options):
    engine = LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", page_size=4, **options))
    ids = [engine.add_request(prompt, sp) for prompt, sp in items]
    done, ks, overlapped = {}, [], False
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if engine.last_step is not None:
            ks.append(engine.last_step.decode_steps)
            overlapped |= engine.last_step.overlapped
    return [done[i] for i in ids], ks, overlapped


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_decode_windows_equal_single_steps(tiny_dirs, overlap):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 19, 33, 11, 24)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.9, seed=3, max_tokens=14, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=True),
        SamplingParams(temperature=0.7, seed=8, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=20,
                       forced_token_ids=[17, 400, 5, 250, 33, 2]),
    ]
    items = list(zip(prompts, params))
    ref, ref_ks, _ = run_engine(tiny_dirs["qwen3"], items, overlap_decode=False)
    got, ks, overlapped = run_engine(tiny_dirs["qwen3"], items, decode_steps=4, overlap_decode=overlap)
    assert set(ref_ks) == {1} and max(ks) == 4 and overlapped is overlap
    for p, a, b in zip(params, ref, got):
        assert b.token_ids == a.token_ids
        if not p.top_logprobs:
            assert a.top_logprobs is None and b.top_logprobs is None
            continue
        assert len(b.top_logprobs) == len(b.token_ids)
        assert [[t for t, _ in top] for top in b.top_logprobs] == [[t for t, _ in top] for top in a.top_logprobs]
        torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in b.top_logprobs]),
                                   torch.tensor([[v for _, v in top] for top in a.top_logprobs]), rtol=0, atol=1e-6)
        if p.is_greedy:
            forced = len(p.forced_token_ids)
            assert [top[0][0] for top in b.top_logprobs][forced:] == b.token_ids[forced:]
