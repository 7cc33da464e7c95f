"""KVzip against a reference written from the paper over the full attention matrix.

The reference runs our model code over [held history + repeat prompt + context chunk] with dense attention
under an explicit per-(layer, KV head) visibility mask, takes each held position's max attention over the
reconstruction rows and the query heads of its KV head, selects the globally highest scores with python
loops, and rounds each layer up to its largest head. Kept sets per (layer, KV head) and greedy tokens (a
masked dense decode) are compared, for a batch of mixed lengths and across two chain turns.
"""

import random

import pytest
import torch

import policies.kvzip  # noqa: F401  (registers "kvzip")
from engine import LLM, SamplingParams
from engine.errors import ConfigError
from policies.kvzip import DEFAULT_REPEAT_PROMPT
from tests.chain_helpers import random_tokens, run_chain_turn
from tests.dense_reference import RecordingRunner, greedy_with_mask

PAGE = 4
MAX_NEW = 6
CFG = dict(ratio=0.3, window=4, chunk_size=16)


def params(max_new=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)


def make_llm(model_dir, method="kvzip", cfg=None):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16, num_pages=256,
               method=method, method_config=CFG if cfg is None else cfg)


def epoch_mask(epochs, heads, T):
    """[Hkv, T, T]: causal; a row at or after an epoch's boundary (the latest such epoch) sees, before the
    boundary, only that epoch's kept positions of its KV head."""
    m = torch.ones(T, T, dtype=torch.bool).tril().repeat(heads, 1, 1)
    for i in range(T):
        live = [e for e in epochs if e[0] <= i]
        if not live:
            continue
        boundary, kept = live[-1]
        for h in range(heads):
            m[h, i, :boundary] = False
            for p in kept[h]:
                m[h, i, p] = True
    return m


def reference_keep(model, tokens, epochs, repeat_ids, cfg, num_layers, heads):
    """Kept positions per layer and KV head after the prompt ``tokens`` (P), whose history rows saw ``epochs``
    (a list of (boundary, kept[layer][head] positions))."""
    P = len(tokens)
    held = [[sorted(set(epochs[-1][1][layer][h]) | set(range(epochs[-1][0], P))) if epochs else list(range(P))
             for h in range(heads)] for layer in range(num_layers)]
    score = {}
    for lo in range(0, P, cfg["chunk_size"]):
        seq = tokens + repeat_ids + tokens[lo: lo + cfg["chunk_size"]]
        T = len(seq)

        def visible(layer, T_):
            m = epoch_mask([(b, k[layer]) for b, k in epochs], heads, T_)
            for h in range(heads):
                m[h, P:, :P] = False
                for p in held[layer][h]:
                    m[h, P:, p] = True
            return m

        runner = RecordingRunner(visible)
        with torch.no_grad():
            model(torch.tensor(seq), torch.arange(T), runner)
        for layer in range(num_layers):
            probs = runner.probs[layer]
            group = probs.shape[0] // heads
            for h in range(heads):
                for p in held[layer][h]:
                    v = float(probs[h * group:(h + 1) * group, P:, p].max())
                    score[layer, h, p] = max(score.get((layer, h, p), 0.0), v)
    for key in score:
        if key[2] >= P - cfg["window"]:
            score[key] = float("inf")
    b = cfg["budget"] if cfg.get("budget") else max(cfg["window"], round(cfg["ratio"] * P))
    if b >= P:
        return held
    items = sorted(score, key=lambda k: (-score[k], k[0], k[1], held[k[0]][k[1]].index(k[2])))
    chosen = items[: b * num_layers * heads]
    kept = []
    for layer in range(num_layers):
        n = max(sum(1 for k in chosen if k[:2] == (layer, h)) for h in range(heads))
        kept.append([sorted(sorted(held[layer][h], key=lambda p: (-score[layer, h, p], p))[:n]) for h in range(heads)])
    return kept


def record_prompt_evictions(llm):
    """Kept positions per layer of every request right after its prompt-end step."""
    method, cache = llm.engine.method, llm.engine.cache
    num_layers = llm.engine.model_config.num_layers
    seen, inner = {}, method.end_step

    def end_step(batch):
        inner(batch)
        for req in batch.finished_prompt:
            seen[req.request_id] = [cache.positions_of(req, layer).tolist() for layer in range(num_layers)]

    method.end_step = end_step
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_batch_of_mixed_lengths_keeps_the_reference_sets_and_tokens(tiny_dirs, arch):
    llm = make_llm(tiny_dirs[arch])
    engine = llm.engine
    mc = engine.model_config
    rng = random.Random(0)
    prompts = [random_tokens(rng, n) for n in (40, 70, 9)]
    seen = record_prompt_evictions(llm)
    outs = llm.generate(prompts, params())
    repeat_ids = engine.tokenizer.encode(DEFAULT_REPEAT_PROMPT, add_special_tokens=False)
    assert repeat_ids
    for prompt, out in zip(prompts, outs):
        expected = reference_keep(engine.model, prompt, [], repeat_ids, CFG, mc.num_layers, mc.num_kv_heads)
        assert seen[out.request_id] == expected
        lens = [len(k[0]) for k in expected]
        assert sum(lens) < mc.num_layers * len(prompt)  # something was evicted
        visible = lambda layer, T, P=len(prompt), kept=expected: epoch_mask([(P, kept[layer])], mc.num_kv_heads, T)
        assert out.token_ids == greedy_with_mask(engine.model, prompt, MAX_NEW, visible)


def test_global_budgets_differ_across_layers_and_every_head_keeps_its_top_scores(tiny_dirs):
    """Non-uniform budgets: with one prompt the layers' kept counts differ, and they sum to at least the
    global target."""
    llm = make_llm(tiny_dirs["llama"], cfg=dict(budget=20, window=4, chunk_size=32))
    mc = llm.engine.model_config
    seen = record_prompt_evictions(llm)
    prompt = random_tokens(random.Random(3), 90)
    out = llm.generate([prompt], params(2))[0]
    counts = [len(k[0]) for k in seen[out.request_id]]
    assert sum(counts) * mc.num_kv_heads >= 20 * mc.num_layers * mc.num_kv_heads
    repeat_ids = llm.engine.tokenizer.encode(DEFAULT_REPEAT_PROMPT, add_special_tokens=False)
    expected = reference_keep(llm.engine.model, prompt, [], repeat_ids, dict(budget=20, window=4, chunk_size=32),
                              mc.num_layers, mc.num_kv_heads)
    assert seen[out.request_id] == expected


def test_compacted_state_serves_the_next_chain_turn(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"])
    engine = llm.engine
    mc = engine.model_config
    heads, num_layers = mc.num_kv_heads, mc.num_layers
    rng = random.Random(7)
    repeat_ids = engine.tokenizer.encode(DEFAULT_REPEAT_PROMPT, add_special_tokens=False)

    prompt1 = random_tokens(rng, 48)
    out1 = run_chain_turn(engine, "c", prompt1, params())
    kept1 = reference_keep(engine.model, prompt1, [], repeat_ids, CFG, num_layers, heads)
    P1 = len(prompt1)
    visible1 = lambda layer, T: epoch_mask([(P1, kept1[layer])], heads, T)
    assert out1.token_ids == greedy_with_mask(engine.model, prompt1, MAX_NEW, visible1)

    history = prompt1 + out1.token_ids
    prompt2 = history + random_tokens(rng, 20)
    out2 = run_chain_turn(engine, "c", prompt2, params())
    assert out2.resume_status == "resumed" and out2.num_resumed_tokens == len(history) - 1
    assert out2.num_prefilled_tokens == len(prompt2) - len(history) + 1
    kept2 = reference_keep(engine.model, prompt2, [(P1, kept1)], repeat_ids, CFG, num_layers, heads)
    state = engine.chains.index.get("c")
    P2 = len(prompt2)
    for layer in range(num_layers):
        positions = engine.cache.table_positions(state.table, layer)
        assert [[p for p in row if p < P2] for row in positions.tolist()] == kept2[layer]
    visible2 = lambda layer, T: epoch_mask([(P1, kept1[layer]), (P2, kept2[layer])], heads, T)
    assert out2.token_ids == greedy_with_mask(engine.model, prompt2, MAX_NEW, visible2)
    engine.delete_chain("c")
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_budget_at_least_the_prompt_reproduces_dense(tiny_dirs):
    rng = random.Random(5)
    prompts = [random_tokens(rng, n) for n in (30, 55)]
    dense = make_llm(tiny_dirs["qwen2"], method="dense", cfg={}).generate(prompts, params())
    kvzip = make_llm(tiny_dirs["qwen2"], cfg=dict(budget=64, window=4))
    seen = record_prompt_evictions(kvzip)
    outs = kvzip.generate(prompts, params())
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for prompt, out in zip(prompts, outs):
        assert all(row == list(range(len(prompt))) for layer in seen[out.request_id] for row in layer)


def test_a_prompt_without_room_for_the_reconstruction_is_kept_whole(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"], cfg=dict(budget=16, window=4))
    seen = record_prompt_evictions(llm)
    limit = llm.engine.model_config.max_position_embeddings
    prompt = random_tokens(random.Random(9), limit - 4)
    out = llm.generate([prompt], params(2))[0]
    assert all(row == list(range(len(prompt))) for layer in seen[out.request_id] for row in layer)


@pytest.mark.parametrize("cfg,words", [
    (dict(ratio=0.0), "ratio"), (dict(ratio=1.5), "ratio"), (dict(ratio=True), "ratio"), (dict(budget=-1), "budget"),
    (dict(budget=2, window=4), "budget"), (dict(window=0), "window"), (dict(chunk_size=0), "chunk_size"),
    (dict(repeat_prompt=3), "repeat_prompt"), (dict(nope=1), "nope"),
])
def test_bad_knobs_are_config_errors(cfg, words):
    from engine.registry import create_method

    with pytest.raises(ConfigError, match=words):
        create_method("kvzip", cfg)
