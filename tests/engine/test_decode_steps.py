"""Back-to-back decode steps (``EngineConfig.decode_steps``): k decode steps run on the device per schedule,
each reading the tokens the previous one sampled, and the host takes their tokens once.

Reference: the same engine with ``decode_steps=1`` (one host round trip per token), which the engine tests
check against HF transformers. Every output must be the same (tokens, log-probabilities, text, finish and
stop reasons), whatever step inside a window a request stops at; and the k-step path must really run. Every
test runs twice: windows read one at a time (``serial``) and each window launched before the previous one is
read (``overlap``, ``EngineConfig.overlap_decode``: a request that stops in a window has the next computed and
dropped).
"""

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError

COMMON = dict(dtype="float32", device="cpu", page_size=4)
OVERLAPPED: list[bool] = []  # StepTiming.overlapped of every window ``run`` took


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request, monkeypatch):
    monkeypatch.setitem(COMMON, "overlap_decode", request.param)
    OVERLAPPED.clear()
    return request.param


def prompts(seed=0, lens=(5, 23, 41, 17)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def run(model_dir, items, decode_steps, **options):
    """items: (prompt, params[, chain_id]); returns (outputs in order, step() outputs per request, k per step)."""
    serial = {"overlap_decode": False} if decode_steps == 1 else {}  # the reference: plain single steps
    engine = LLMEngine(EngineConfig(model_dir, decode_steps=decode_steps, **{**COMMON, **serial, **options}))
    ids = [engine.add_request(p, sp, chain_id=c) for p, sp, c in ((*i, None)[:3] for i in items)]
    final, streamed, ks = {}, {i: [] for i in ids}, []
    while engine.has_unfinished():
        outs = engine.step()
        if engine.last_step is not None:
            ks.append(engine.last_step.decode_steps)
            OVERLAPPED.append(engine.last_step.overlapped)
        assert len({o.request_id for o in outs}) == len(outs)  # one output per request per step
        for o in outs:
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o
    return [final[i] for i in ids], [streamed[i] for i in ids], ks


def assert_same(ref, got):
    for a, b in zip(ref, got):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
        if a.logprobs is not None:
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-6)


def test_greedy_mixed_lengths_equal_single_steps(tiny_dirs, overlap):
    items = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=True))
             for p, m in zip(prompts(), (7, 13, 3, 20))]
    ref, _, ref_ks = run(tiny_dirs["qwen3"], items, 1)
    OVERLAPPED.clear()
    got, streamed, ks = run(tiny_dirs["qwen3"], items, 4)
    assert_same(ref, got)
    assert any(OVERLAPPED) is overlap
    assert [s for s in streamed] == [o.token_ids for o in got]  # the streamed deltas add up
    assert set(ref_ks) == {1} and max(ks) == 4 and (2 in ks or 3 in ks)  # full windows and shortened ones
    assert len(ks) < len(ref_ks)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "glm4_moe_lite", "qwen3_next"])
def test_stop_tokens_and_strings_inside_a_window(tiny_dirs, arch):
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (free,), _, _ = run(tiny_dirs[arch], [(prompts(1, (30,))[0], base)], 1)
    stop_token = free.token_ids[5]  # the 6th token: inside the second window of 4
    by_token = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token])
    text = free.text
    stop_str = text[len(text) // 2: len(text) // 2 + 2] or text[-1:]
    by_string = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop_str])
    items = [(prompts(1, (30,))[0], by_token), (prompts(1, (30,))[0], by_string), (prompts(2, (9,))[0], base)]
    ref, _, _ = run(tiny_dirs[arch], items, 1)
    got, _, ks = run(tiny_dirs[arch], items, 4)
    assert ref[0].finish_reason == "stop" and ref[0].token_ids[-1] == stop_token
    assert_same(ref, got)
    assert max(ks) == 4


def test_seeded_sampling_and_forced_tokens_equal_single_steps(tiny_dirs):
    forced = [11, 12, 13, 14, 15, 16]
    items = [
        (prompts(3)[0], SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=11,
                                       ignore_eos=True, logprobs=True)),
        (prompts(3)[1], SamplingParams(temperature=1.0, min_p=0.05, seed=3, max_tokens=9, ignore_eos=True)),
        (prompts(3)[2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True,
                                       forced_token_ids=forced)),
    ]
    ref, _, _ = run(tiny_dirs["qwen2"], items, 1)
    got, _, ks = run(tiny_dirs["qwen2"], items, 3)
    assert got[2].token_ids[:6] == forced
    assert_same(ref, got)
    assert max(ks) == 3


@pytest.mark.parametrize("arch,prune", [("llama", False), ("llama", True), ("qwen3_next", False)],
                         ids=["plain", "pruned", "hybrid"])
def test_chain_turns_resume_the_same_state(tiny_dirs, arch, prune):
    """Three turns of a chain: a k-step turn leaves the chain's KV exactly as single steps do (the next turn
    resumes the same number of tokens and generates the same tokens); ``pruned``: an interval of the chain is
    pruned after the first turn (a compacted table: the window's slots follow its physical length); ``hybrid``:
    a recurrent state cannot be given back past a stop, so a hybrid's chain turns run single steps."""
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (ref_free,), _, _ = run(tiny_dirs[arch], [(prompts(4, (21,))[0], free)], 1)
    # the first turn stops on a token inside a window (pages taken ahead go back), the second at its length
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[ref_free.token_ids[5]])

    def turns(k):
        engine = LLMEngine(EngineConfig(tiny_dirs[arch], decode_steps=k, **COMMON))
        history, out, infos = prompts(4, (21,))[0], [], []
        fields = ("logical_tokens", "computed_tokens", "physical_tokens", "pages_held")
        for t in range(3):
            if prune and t == 1:
                assert engine.prune_chain("c", [(4, 14)], defer=False).status == "applied"
            rid = engine.add_request(list(history), params, chain_id="c")
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished and o.request_id == rid:
                        out.append((o.token_ids, o.finish_reason, o.num_resumed_tokens, o.num_prefilled_tokens))
            info = engine.chain_info("c")
            infos.append([getattr(info, f) for f in fields])
            history += out[-1][0] + [7, 8, 9]
        return out, infos

    (ref, ref_infos), (got, infos) = turns(1), turns(4)
    assert got == ref and ref[0][1] == "stop" and ref[1][2] > 0
    assert infos == ref_infos  # no page taken ahead stays with the chain
    if prune:
        assert all(n < ref_infos[1][0] for n in ref_infos[1][2])  # fewer physical than logical tokens


def test_a_pool_too_small_for_the_extra_steps_falls_back(tiny_dirs):
    """Pages for the window are taken ahead; when the pool cannot give them the step runs alone."""
    items = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts(5, (15, 15))]
    ref, _, _ = run(tiny_dirs["qwen3"], items, 1, num_pages=12)
    got, _, ks = run(tiny_dirs["qwen3"], items, 8, num_pages=12)
    assert_same(ref, got)
    assert 1 in ks[2:] and max(ks) > 1  # some windows could not be allocated, others could


@pytest.mark.parametrize("method,cfg,windowed", [
    ("snapkv", {"budget": 16, "window": 4}, True),  # evicted for good: its hooks do nothing any more
    ("pyramidkv", {"budget": 16, "window": 4}, True),  # layers of different lengths
    ("kvzip", {"budget": 12, "window": 4}, True),  # non-uniform budgets across layers and heads
    ("snapkv", {"budget": 16, "window": 4, "reeval_every": 3}, False),  # re-evaluates: never windowed
    ("h2o", {"heavy_budget": 8, "recent_budget": 8}, False),  # scores every decode step
    ("rkv", {"budget": 16, "buffer": 8, "alpha": 2}, True),  # windows end before each compression's window
    ("streaming_llm", {"sink_tokens": 4, "window": 12, "slack": 6}, True),  # windows end at each compaction
    ("knorm", {"budget": 16}, True),  # compresses once, after the prompt
    ("knorm", {"budget": 16, "evict_every": 5, "slack": 2}, True),  # windows end before each check
    ("quest", {"token_budget": 16, "dense_layers": 1}, True),  # selection: device work over each step's batch
    ("omnikv", {"token_budget": 16}, True),
])
def test_methods_window_only_when_their_hooks_allow(tiny_dirs, method, cfg, windowed, overlap):
    items = [(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=True))
             for p in prompts(6)]
    options = dict(method=method, method_config=cfg)
    ref, _, _ = run(tiny_dirs["qwen3"], items, 1, **options)
    got, _, ks = run(tiny_dirs["qwen3"], items, 4, **options)
    assert_same(ref, got)
    assert (max(ks) > 1) is windowed
    if overlap:  # single steps, each launched before the last is read (windows of one)
        OVERLAPPED.clear()
        single, _, _ = run(tiny_dirs["qwen3"], items, 1, overlap_decode=True, **options)
        assert_same(ref, single)
        bounded = method in ("rkv", "streaming_llm") or bool(cfg.get("evict_every"))  # windows end at compactions
        assert any(OVERLAPPED) is (windowed and not bounded)  # the next step is launched early only when unbounded


def test_requests_of_several_methods_run_single_steps(tiny_dirs):
    """A batch whose requests name different methods (each method's hooks see its own sub-batch) runs plain
    steps, whatever ``decode_steps``: the same outputs as single steps."""
    ps = prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    methods = [None, ("snapkv", {"budget": 12, "window": 4}), None, ("quest", {"token_budget": 8})]
    ref = LLM(tiny_dirs["qwen3"], **{**COMMON, "overlap_decode": False}).generate(ps, params, methods=methods)
    got = LLM(tiny_dirs["qwen3"], decode_steps=4, **COMMON).generate(ps, params, methods=methods)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_llm_generate_and_bad_values(tiny_dirs):
    ps = prompts(7)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = LLM(tiny_dirs["qwen3"], **COMMON).generate(ps, params)
    got = LLM(tiny_dirs["qwen3"], decode_steps=5, **COMMON).generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="decode_steps must be a positive int"):
            EngineConfig(tiny_dirs["qwen3"], decode_steps=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gpu_windows_replay_graphs_and_equal_single_steps(tiny_dirs, arch):
    """On a GPU the window's steps replay the decode CUDA graphs back to back (fp32: tokens equal)."""
    items = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=True))
             for p, m in zip(prompts(8), (9, 17, 4, 12))]
    gpu = dict(dtype="float32", device="cuda", page_size=16, num_pages=256, attention_backend="triton",
               max_num_seqs=8, overlap_decode=COMMON["overlap_decode"])  # num_pages: the suite's other GPU workers hold memory a utilization share misjudges
    engines = []
    for k in (1, 4):
        engine = LLMEngine(EngineConfig(tiny_dirs[arch], decode_steps=k, **gpu))
        ids = [engine.add_request(p, sp) for p, sp in items]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engines.append(([done[i] for i in ids], engine.runner.graphs.replays))
    (ref, ref_replays), (got, replays) = engines
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(ref, got):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
    assert replays >= ref_replays > 0


def test_step_kinds_are_counted_exactly(tiny_dirs, overlap):
    """StepTiming: prompt tokens per step and the step's kind (what the server's per-kind counters add up)."""
    if overlap:
        pytest.skip("the serial sequence; test_overlapped_windows_are_counted_exactly counts the overlapped one")
    engine = LLMEngine(EngineConfig(tiny_dirs["qwen3"], max_num_batched_tokens=16, decode_steps=3, **COMMON))
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    engine.add_request(prompts(9, (40,))[0], params)
    seen = []
    while engine.has_unfinished():
        engine.step()
        t = engine.last_step
        seen.append((t.kind, t.prefill_tokens, t.num_tokens, t.decode_steps))
        if len(seen) == 4:
            engine.add_request(prompts(10, (20,))[0], params)  # joins while the first decodes
    # 40 prompt tokens in chunks of 16 (the last samples the first token); a window of 3; the second
    # request's 20-token prompt in two steps shared with the first's decodes (15 + 1, 5 + 1); a step of both
    # (the first has one token left: no window); the second alone: windows of 3 and 2 (its 5 last tokens)
    assert seen == [("prefill", 16, 16, 1), ("prefill", 16, 16, 1), ("prefill", 8, 8, 1), ("decode-eager", 0, 1, 3),
                    ("mixed", 15, 16, 1), ("mixed", 5, 6, 1), ("decode-eager", 0, 2, 1), ("decode-eager", 0, 1, 3),
                    ("decode-eager", 0, 1, 2)]


@pytest.mark.parametrize("storage,cfg,windowed", [("fp8", {}, True), ("turboquant", {"bits": 3}, True),
                                                  ("palu", {"rank_ratio": 0.75}, True),
                                                  ("kivi", {"bits": 4, "group_size": 4, "residual": 4}, True),
                                                  ("kivi", {"bits": 2, "group_size": 4, "residual": 8}, True)])
def test_codecs_run_windows(tiny_dirs, storage, cfg, windowed, overlap):
    """Under every codec back-to-back steps equal single steps: windowless ones read every slot from codes
    (Palu with positions); KIVI's window writes (ring row, open group) are planned on the device each step."""
    items = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=True))
             for p, m in zip(prompts(11), (9, 6, 12, 4))]
    options = dict(kv_storage=storage, kv_storage_config=cfg)
    ref, _, _ = run(tiny_dirs["qwen3"], items, 1, **options)
    got, _, ks = run(tiny_dirs["qwen3"], items, 4, **options)
    assert_same(ref, got)
    assert (max(ks) > 1) is windowed
    if overlap:  # single steps, each launched before the last is read
        OVERLAPPED.clear()
        assert_same(ref, run(tiny_dirs["qwen3"], items, 1, overlap_decode=True, **options)[0])
        assert any(OVERLAPPED)
