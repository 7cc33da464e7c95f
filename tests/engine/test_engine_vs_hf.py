"""Greedy output of the engine is token-identical to HF transformers generate (fp32, CPU)."""

import random

import pytest

from engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5",
         "qwen3_5_moe"]
MAX_NEW = 10
PAGE = 16


def make_prompts(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(40)]
    lengths = [5, 300, 17, 64, 130, 33, 8, 250, 91]
    prompts = []
    for i, n in enumerate(lengths):
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(system + body if i % 2 == 0 else body)
    return system, prompts


def eos_ids(llm: LLM) -> list[int]:
    return sorted(llm.engine.model_config.eos_token_ids)


def assert_all_pages_free(llm: LLM) -> None:
    engine = llm.engine
    assert all(engine.pool.ref_counts[p] == 0 for p in range(engine.pool.num_pages))
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.cache.prefix_index is None or len(engine.cache.prefix_index) == 0
    if engine.cache.spec.recurrent_layers:  # every recurrent-state slot is back
        assert engine.cache.storage.free_states == engine.cache.spec.max_states


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_prefix_hits_matches_hf(arch, tiny_dirs, make_llm):
    model_dir = tiny_dirs[arch]
    llm = make_llm(arch, page_size=PAGE, max_num_batched_tokens=32)
    system, prompts = make_prompts(llm.engine.model_config.vocab_size, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    llm.generate([system + [5]], params)  # warm the prefix cache with the shared system prompt

    plans = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: plans.append(p := schedule()) or p
    outputs = llm.generate(prompts, params)

    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(model_dir, prompt, MAX_NEW, eos_ids(llm)), f"prompt of {len(prompt)}"
        if prompt[: len(system)] == system and llm.engine.cache.spec.prefix_reusable:
            assert out.num_cached_tokens >= (len(system) // PAGE) * PAGE
    assert all(p.num_tokens <= 32 for p in plans)
    mixed = [p for p in plans if any(n == 1 for n in p.num_new_tokens) and any(n > 1 for n in p.num_new_tokens)]
    assert mixed, "expected steps that mix decode tokens with prefill chunks"
    assert_all_pages_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_tiny_page_budget_matches_hf(arch, tiny_dirs, make_llm):
    model_dir = tiny_dirs[arch]
    llm = make_llm(arch, page_size=PAGE, num_pages=24, max_num_batched_tokens=64, enable_prefix_caching=False)
    _, prompts = make_prompts(llm.engine.model_config.vocab_size, seed=11)
    prompts = [p for p in prompts if len(p) < 200]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model_dir, prompt, MAX_NEW, eos_ids(llm))
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_second_run_reuses_every_full_prompt_page(make_llm):
    llm = make_llm("qwen3", page_size=PAGE, num_pages=40, max_num_batched_tokens=64)
    system, prompts = make_prompts(llm.engine.model_config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    shared = [p for p in prompts if p[:40] == system and len(p) < 300]
    first = llm.generate(shared, params)
    second = llm.generate(shared, params)
    for a, b, prompt in zip(first, second, shared):
        assert a.token_ids == b.token_ids
        assert b.num_cached_tokens == ((len(prompt) - 1) // PAGE) * PAGE
    assert_all_pages_free(llm)
