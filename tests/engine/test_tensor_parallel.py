"""Tensor parallelism on CPU: 2 gloo ranks (rank 0 in this process, rank 1 a spawned worker) against the same
engine at tensor_parallel_size 1 (itself checked against HF transformers in test_engine_vs_hf).

Greedy tokens must be equal; logprobs of the chosen tokens agree to fp32 rounding (the row-parallel all-reduce
sums the two ranks' partial products in a different order than one matmul does; the measured difference is
printed). Methods that keep or select per KV head are checked slot by slot: rank 0 holds KV head 0, so its kept
positions must be exactly row 0 of what the single-rank engine keeps.
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from engine.parallel.workers import TensorParallelError

PROMPTS = [[(7 * i + 3 * j) % 480 + 5 for j in range(n)] for i, n in enumerate([5, 23, 41])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, ignore_eos=True)
COMMON = dict(dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=16, num_pages=256)


def engine(model_dir, tp, **options):
    return LLMEngine(EngineConfig(model_dir, tensor_parallel_size=tp, **COMMON, **options))


def generate(eng, prompts, record=None):
    """Greedy outputs {request id: (tokens, logprobs)}; ``record(eng, req)`` runs once per request right after
    the step that sampled its first token (its prompt's KV is final)."""
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    seen, recorded, out = set(), {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = (o.token_ids, o.logprobs)
        for rid, req in eng._requests.items():
            if record is not None and rid not in seen and len(req.output_token_ids) == 1:
                seen.add(rid)
                recorded[rid] = record(eng, req)
    return [out[i] for i in ids], [recorded.get(i) for i in ids]


def assert_same_greedy(ref, got):
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(ref, got) for a, b in zip(la, lb))
    print(f"max |logprob TP1 - TP2| over the chosen tokens: {diff:.3g}")
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert diff < 1e-4


def kept_positions(eng, req):
    return [eng.cache.positions_of(req, layer).clone() for layer in range(eng.model_config.num_layers)]


def worker_procs(eng):
    return list(eng._tp_link.procs)


def assert_gone(procs):
    for p in procs:
        assert p.exitcode is not None and not os.path.exists(f"/proc/{p.pid}")
    assert not dist.is_initialized()


def test_bad_configs_raise_before_any_process_starts(tiny_dirs, tmp_path):
    uneven = tmp_path / "three_kv_heads"
    shutil.copytree(tiny_dirs["qwen3"], uneven)
    cfg = json.loads((uneven / "config.json").read_text())
    cfg.update(num_attention_heads=6, num_key_value_heads=3)
    (uneven / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="must divide the number of KV heads"):
        engine(uneven, 2)
    with pytest.raises(ConfigError, match="exceeds the model's 2 KV heads"):
        engine(tiny_dirs["qwen3"], 4)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tiny_dirs["qwen3"], tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="budget"):  # method knobs are checked before the ranks start
        engine(tiny_dirs["qwen3"], 2, method="snapkv", method_config={"budget": 0})
    assert torch.multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_dense_and_chain_turn_tp2_equal_tp1_then_a_dead_rank_is_named(tiny_dirs):
    # Llama, not Qwen3: Qwen3's key RMSNorm with unit weights gives every key the same norm, so the knorm
    # prune below would rank keys by fp32 rounding, which the all-reduce's summation order changes.
    model_dir = tiny_dirs["llama"]
    history = PROMPTS[2]

    def chain_turns(eng):
        first = eng.add_request(history, GREEDY, chain_id="c")
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        turn2 = history + outs[first].token_ids + [11, 12, 13]
        second = eng.add_request(turn2, GREEDY, chain_id="c")
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        eng.prune_chain("c", [(4, 20)], scorer="knorm", keep_ratio=0.5)  # per (layer, KV head): local
        # one score per position over every (layer, KV head) row: the ranks reduce their rows together
        assert eng.prune_chain("c", [(20, 34)], scorer="snapkv_global", keep_ratio=0.5).tokens_freed == 7
        third = eng.add_request(turn2 + outs[second].token_ids + [14, 15], GREEDY, chain_id="c")
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        turns = (first, second, third)
        return [(outs[r].token_ids, outs[r].logprobs) for r in turns], outs[second].num_resumed_tokens

    ref_eng = engine(model_dir, 1)
    ref, _ = generate(ref_eng, PROMPTS)
    ref_chain, ref_resumed = chain_turns(ref_eng)
    eng = engine(model_dir, 2)
    procs = worker_procs(eng)
    try:
        assert eng.cache.spec.num_kv_heads == 1  # rank 0 holds one of the two KV heads
        assert eng.model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == (2 + 1 + 1) * 16
        got, _ = generate(eng, PROMPTS)
        assert_same_greedy(ref, got)
        got_chain, resumed = chain_turns(eng)
        assert resumed == ref_resumed > 0  # the second turn re-attached the chain's retained KV
        assert_same_greedy(ref_chain, got_chain)

        procs[0].kill()
        procs[0].join()
        with pytest.raises(TensorParallelError, match="rank 1 died"):
            generate(eng, PROMPTS[:1])
        with pytest.raises(TensorParallelError, match="unusable"):
            eng.step()
    finally:
        eng.close()
    assert_gone(procs)


@pytest.mark.parametrize("arch,method,config", [
    ("qwen3_moe", "snapkv", {"budget": 12, "window": 4, "kernel_size": 3}),
    ("llama", "quest", {"token_budget": 8, "dense_layers": 1}),
    ("qwen2", "omnikv", {"observation_layers": (0,), "token_budget": 10}),
    ("qwen3", "tova", {"budget": 12}),
    ("llama", "kvzip", {"budget": 12, "window": 4, "chunk_size": 16}),
])
def test_method_tp2_equals_tp1(tiny_dirs, arch, method, config):
    """Rank 0 (KV head 0) must keep exactly the single rank's head-0 slots and every token must agree.
    SnapKV keeps per KV head (on the MoE model: experts split over their intermediate dim). Quest (max over query
    heads) and OmniKV (sum) reduce page / slot scores across ranks; TOVA averages over all query heads (mean
    across ranks); KVzip picks its global top scores over every layer and KV head (gathered from all ranks; its
    reconstruction probe runs the sharded model on both ranks)."""
    options = dict(method=method, method_config=config)
    ref_eng = engine(tiny_dirs[arch], 1, **options)
    ref, ref_kept = generate(ref_eng, PROMPTS, kept_positions)
    with engine(tiny_dirs[arch], 2, **options) as eng:
        procs = worker_procs(eng)
        got, kept = generate(eng, PROMPTS, kept_positions)
    assert_gone(procs)
    assert [p.exitcode for p in procs] == [0]
    assert_same_greedy(ref, got)
    for ref_layers, layers in zip(ref_kept, kept):
        for r, g in zip(ref_layers, layers):
            assert torch.equal(g, r[:1])
    if method in ("snapkv", "tova"):
        assert ref_kept[2][0].shape == (2, 12)  # the 41-token prompt was cut to the budget
    if method == "kvzip":
        assert sum(k.shape[1] for k in ref_kept[2]) < 2 * 41  # evicted, with per-layer budgets


def test_per_request_methods_at_tp2(tiny_dirs):
    """Requests of several methods in one batch at TP=2 emit what each emits alone at TP=1 under its method;
    a method taken on ahead (``check_method``, as the server does at chain creation) exists on every rank."""
    snap = ("snapkv", {"budget": 12, "window": 4, "kernel_size": 3})
    quest = ("quest", {"token_budget": 8, "dense_layers": 1})
    choice = [None, snap, quest]
    refs = []
    for prompt, m in zip(PROMPTS, choice):
        options = {} if m is None else dict(method=m[0], method_config=m[1])
        refs.append(generate(engine(tiny_dirs["llama"], 1, **options), [prompt])[0][0])
    with engine(tiny_dirs["llama"], 2) as eng:
        procs = worker_procs(eng)
        assert eng.check_method(*quest) == "quest"
        ids = [eng.add_request(p, GREEDY, method=None if m is None else m[0],
                               method_config=None if m is None else m[1]) for p, m in zip(PROMPTS, choice)]
        out = {}
        while eng.has_unfinished():
            out.update({o.request_id: (o.token_ids, o.logprobs) for o in eng.step() if o.finished})
    assert_gone(procs)
    assert_same_greedy(refs, [out[i] for i in ids])


def test_serve_tp_reaches_the_engine_config(tiny_dirs, capsys):
    from agentrt.cli import main

    assert main(["serve", "--model", str(tiny_dirs["qwen3"]), "--tp", "3", "--no-auth"]) == 2
    assert "tensor_parallel_size 3 exceeds the model's 2 KV heads" in capsys.readouterr().err
    assert torch.multiprocessing.active_children() == []


def test_a_rank_failure_is_raised_in_rank_0_with_the_rank_and_its_traceback(tiny_dirs):
    eng = engine(tiny_dirs["qwen3"], 2)
    procs = worker_procs(eng)
    try:
        # rank 0 succeeds, rank 1 fails outside the contract (an AttributeError): reported, and rank 1 exits
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 failed in no_such_call:.*AttributeError"):
            eng._tp_link.call("no_such_call", (), {}, lambda: None)
        with pytest.raises(TensorParallelError, match="unusable"):
            eng.add_request([5, 6, 7], GREEDY)
    finally:
        eng.close()
    assert_gone(procs)
    assert [p.exitcode for p in procs] == [1]


def test_every_public_engine_call_but_the_read_only_ones_is_mirrored_to_the_ranks():
    read_only = {"has_unfinished", "chain_info", "prune_result", "close"}
    public = {n for n, f in vars(LLMEngine).items() if callable(f) and not n.startswith("_")}
    mirrored = {n for n in public if hasattr(getattr(LLMEngine, n), "__wrapped__")}
    assert public - read_only == mirrored
    assert {"add_request", "step", "abort", "fork_chain", "rewind_chain", "prune_chain", "delete_chain"} <= mirrored


def test_decode_windows_at_tp2_equal_single_steps_at_tp1(tiny_dirs):
    """Back-to-back decode steps on two ranks: each samples the window's greedy tokens on its own (the
    logits agree after the all-reduce), rank 0's are taken; tokens and log-probs equal TP=1 single steps."""
    ref, _ = generate(engine(tiny_dirs["qwen3"], 1), PROMPTS)
    with engine(tiny_dirs["qwen3"], 2, decode_steps=3) as eng:
        procs = worker_procs(eng)
        windows, step = [], eng.step

        def counting():
            outs = step()
            windows.append(eng.last_step.decode_steps if eng.last_step else 1)
            return outs

        eng.step = counting
        got, _ = generate(eng, PROMPTS)
    assert_gone(procs)
    assert_same_greedy(ref, got)
    assert max(windows) == 3


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_tp2_equals_tp1_through_chunked_prefill_chain_turns_and_prefix_checkpoints(tiny_dirs, arch):
    """Each rank holds a slice of the DeltaNet's key heads with their value heads (and half the attention
    heads): its recurrent and conv states are that slice (asserted from rank 0's storage). Prompts in 16-token
    chunks, a chain's second turn resuming the retained state (prefill = the new tokens), and a request that
    starts from a prefix checkpoint give TP=1's tokens. Qwen3-Next loads the key-head-grouped projections,
    Qwen3.5 the split ones."""
    from engine.model_config import ModelConfig

    lin = ModelConfig.from_dir(tiny_dirs[arch]).linear
    def run(eng):
        outs, resumed = generate(eng, PROMPTS)[0], []
        for turn in range(2):  # the second turn: the first's history, its reply, then new tokens
            prompt = PROMPTS[2] if turn == 0 else PROMPTS[2] + outs[-1][0] + [11, 12, 13, 14, 15]
            rid = eng.add_request(prompt, GREEDY, chain_id="c")
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished and o.request_id == rid:
                        outs.append((o.token_ids, o.logprobs))
                        resumed.append(o.num_resumed_tokens)
        hit = eng.add_request(PROMPTS[1] + [9, 9, 9], GREEDY)  # PROMPTS[1]'s pages are cached with checkpoints
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished and o.request_id == hit:
                    outs.append((o.token_ids, o.logprobs))
                    resumed.append(o.num_cached_tokens)
        return outs, resumed

    ref, ref_resumed = run(engine(tiny_dirs[arch], 1))
    with engine(tiny_dirs[arch], 2) as eng:
        procs = worker_procs(eng)
        spec = eng.cache.spec
        assert spec.recurrent_shape == (lin.linear_num_value_heads // 2, lin.linear_key_head_dim,
                                        lin.linear_value_head_dim)
        assert spec.conv_shape[0] == lin.conv_dim // 2 and spec.num_kv_heads == 1
        assert eng.cache.storage.recurrent.shape[-3:] == spec.recurrent_shape
        got, resumed = run(eng)
    assert_gone(procs)
    assert resumed == ref_resumed and resumed[1] > 0 and resumed[2] > 0  # resumed turn; prefix from a checkpoint
    assert_same_greedy(ref, got)
