"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5) on the engine: chains resume the recurrent state they
retained, fork copies it, rewind and diverging turns recompute (a state exists only at its chain's end), and the
state slots are accounted and given back.

The reference for every output is a fresh engine (no chains, no prefix cache) run on the same full history,
itself equal to HF transformers in test_engine_vs_hf. Methods on hybrid chains (SnapKV, H2O) are checked against
a reference rebuilt from scratch in test_chain_eviction, Quest and OmniKV in test_quest and test_omnikv."""

import random

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from tests.chain_helpers import random_tokens, run_chain_turn

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def reference(model_dir):
    ref = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    return lambda prompt: ref.generate([prompt], PARAMS)[0].token_ids


def assert_all_free(engine):
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.cache.storage.free_states == engine.cache.spec.max_states


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_six_turns_prefill_only_their_new_tokens_and_match_a_fresh_run(tiny_dirs, arch):
    llm = LLM(tiny_dirs[arch], dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16)
    engine, rng, fresh = llm.engine, random.Random(0), reference(tiny_dirs[arch])
    assert engine.cache.spec.recurrent_layers == 2 and engine.cache.spec.num_layers == 2
    history = random_tokens(rng, 30)
    for i in range(6):
        new = random_tokens(rng, rng.choice([3, 9, 40]))
        prompt = history + new
        out = run_chain_turn(engine, "c", prompt, PARAMS)
        assert out.token_ids == fresh(prompt), f"turn {i}"
        if i == 0:
            assert out.resume_status == "created" and out.num_prefilled_tokens == len(prompt)
        else:
            assert out.resume_status == "resumed" and out.num_resumed_tokens == len(history) - 1
            assert out.num_prefilled_tokens == len(new) + 1
        history = prompt + out.token_ids
        info = engine.chain_info("c")
        assert info.status == "idle" and info.computed_tokens == len(history) - 1
    engine.delete_chain("c")
    assert_all_free(engine)


def test_fork_copies_the_state_and_rewind_recomputes(tiny_dirs):
    model_dir = tiny_dirs["qwen3_next"]
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE)
    engine, rng, fresh = llm.engine, random.Random(3), reference(model_dir)
    p1 = random_tokens(rng, 22)
    h = p1 + run_chain_turn(engine, "a", p1, PARAMS).token_ids
    engine.fork_chain("a", "b")
    pa, pb = h + random_tokens(rng, 7), h + random_tokens(rng, 5)
    out_a, out_b = run_chain_turn(engine, "a", pa, PARAMS), run_chain_turn(engine, "b", pb, PARAMS)
    assert out_a.token_ids == fresh(pa) and out_b.token_ids == fresh(pb)
    assert out_b.resume_status == "resumed" and out_b.num_resumed_tokens == len(h) - 1
    pa2 = pa + out_a.token_ids + random_tokens(rng, 3)  # a's state must be intact after b ran on the fork
    out = run_chain_turn(engine, "a", pa2, PARAMS)
    assert out.token_ids == fresh(pa2) and out.resume_status == "resumed"

    engine.rewind_chain("a", len(p1) - 3)  # the state after p1[:-3] was never kept: recomputed
    pr = p1[:-3] + random_tokens(rng, 6)
    out = run_chain_turn(engine, "a", pr, PARAMS)
    assert out.token_ids == fresh(pr) and out.resume_status == "recomputed" and out.num_resumed_tokens == 0
    diverging = pr[:10] + random_tokens(rng, 8)  # a turn that diverges inside the history recomputes too
    out = run_chain_turn(engine, "a", diverging, PARAMS)
    assert out.token_ids == fresh(diverging) and out.resume_status == "recomputed"
    for cid in ("a", "b"):
        engine.delete_chain(cid)
    assert_all_free(engine)


def test_state_slots_come_out_of_the_kv_budget_and_prefix_caching_needs_checkpoints(tiny_dirs):
    budget = 2 * 2**20
    engine = LLMEngine(EngineConfig(tiny_dirs["qwen3_5"], dtype="float32", device="cpu", page_size=PAGE,
                                    kv_cache_memory_bytes=budget, max_num_seqs=8))
    spec = engine.cache.spec
    conv = 4 * 2 * (2 * 2 * 16 + 4 * 16) * 3  # fp32 x 2 linear layers x conv_dim (q, k: 2 heads x 16; v) x taps-1
    recurrent = 4 * 2 * 4 * 16 * 16  # fp32 x 2 linear layers x 4 value heads x 16 x 16
    assert spec.state_bytes == conv + recurrent
    assert engine.pool.num_pages == (budget - 9 * spec.state_bytes) // spec.bytes_per_page
    assert engine.cache.prefix is not None and engine.cache.prefill_alignment == PAGE  # checkpoints (default 32)
    assert engine.cache.storage.conv.shape[1] == engine.cache.storage.recurrent.shape[1] == 9
    off = LLMEngine(EngineConfig(tiny_dirs["qwen3_5"], dtype="float32", device="cpu", page_size=PAGE,
                                 kv_cache_memory_bytes=budget, max_num_seqs=8, prefix_checkpoints=0))
    assert off.cache.prefix is None and off.cache.prefill_alignment == 1


def test_kvzip_and_the_probe_are_refused(tiny_dirs):
    with pytest.raises(ConfigError, match="kvzip scores a prompt by a reconstruction probe"):
        LLM(tiny_dirs["qwen3_5"], dtype="float32", device="cpu", method="kvzip", method_config={"budget": 12})
    engine = LLM(tiny_dirs["qwen3_5"], dtype="float32", device="cpu", page_size=PAGE).engine
    rng = random.Random(4)
    run_chain_turn(engine, "c", random_tokens(rng, 30), PARAMS)
    with pytest.raises(ConfigError, match="recurrent layers would need their state"):
        engine.prune_chain("c", [(4, 20)], scorer="kvzip_global", keep_ratio=0.5)
    assert engine.chain_info("c").compacted is False  # nothing changed


def test_a_hybrid_model_is_no_reason_against_decode_graphs(tiny_dirs):
    """Its pure decode steps read the state slots from a device tensor (tests/engine/test_decode_graph_buffers.py
    replays them over the static buffers): only the CPU device here speaks against graphs."""
    import torch

    from engine.decode_speedups import reasons_against_graphs

    engine = LLM(tiny_dirs["qwen3_next"], dtype="float32", device="cpu").engine
    reasons = reasons_against_graphs(engine.config, torch.device("cuda"), engine.backend, engine.method, 1,
                                     engine.model, engine.model_config.architecture)
    assert not any("Qwen3NextForCausalLM" in r for r in reasons)


def test_only_a_table_that_runs_again_copies_its_state_out(tiny_dirs, monkeypatch):
    """A finished stateless request frees its state slot without copying the state to host memory; a chain's
    turn keeps exactly one copy (conv and recurrent states) for its next turn, and deleting the chain drops it."""
    import engine.storage.recurrent as recurrent

    copies = []
    to_host = recurrent._to_host
    monkeypatch.setattr(recurrent, "_to_host", lambda x: copies.append(x.shape) or to_host(x))
    llm = LLM(tiny_dirs["qwen3_5"], dtype="float32", device="cpu", page_size=PAGE, enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(5)
    llm.generate([random_tokens(rng, 19), random_tokens(rng, 26)], PARAMS)
    assert copies == []
    assert_all_free(engine)
    run_chain_turn(engine, "c", random_tokens(rng, 21), PARAMS)
    storage = engine.cache.storage
    assert copies == [storage.conv[:, 0].shape, storage.recurrent[:, 0].shape]
    assert storage.free_states == engine.cache.spec.max_states  # the idle chain holds no slot
    engine.delete_chain("c")
    assert copies == [storage.conv[:, 0].shape, storage.recurrent[:, 0].shape]
    assert_all_free(engine)
