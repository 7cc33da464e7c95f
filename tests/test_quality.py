"""The shipped trained checkpoint and the quality harness: accuracy through the real engine (greedy).

The reference for every accuracy is the task generator's known answer (exact token match, then the end
token); the loader is checked against Hugging Face transformers' own forward pass on the same checkpoint.
"""

import random

import pytest
import torch

from agentrt.config import embedded_model_dir
from quality.budgets import method_config
from quality.multiturn import pruned_rounds, run_lag, tool_chain
from quality.runner import is_correct, make_engine, run_samples
from quality.tasks import make_sample, needle

LENGTH = 768
DEPTHS = [i / 11 for i in range(12)]


def _accuracy(results: list[bool]) -> float:
    return sum(results) / len(results)


@pytest.fixture(scope="module")
def model_dir():
    return embedded_model_dir()


@pytest.fixture(scope="module")
def dense(model_dir):
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def retrieval(dense):
    """Needles (question last) at depths across the context, and tool-result lookups in the chat format."""
    tok = dense.tokenizer
    needles = [needle(tok, random.Random(f"t-needle-{i}"), LENGTH, d) for i, d in enumerate(DEPTHS)]
    lookups = [make_sample("tool_lookup", tok, random.Random(f"t-tool-{i}"), LENGTH, d)
               for i, d in enumerate(DEPTHS[::2])]
    return needles, lookups


@pytest.fixture(scope="module")
def dense_needles(dense, retrieval):
    return run_samples(dense, retrieval[0])


def test_shipped_checkpoint_loads_through_the_engine_and_matches_transformers(model_dir, dense):
    from transformers import AutoModelForCausalLM

    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= 10 * 2**20
    assert "<|im_start|>" in dense.tokenizer.chat_template and "tools" in dense.tokenizer.chat_template
    ids = needle(dense.tokenizer, random.Random(0), 128, 0.5).prompt_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    from engine import SamplingParams

    rid = dense.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1))
    out = None
    while dense.has_unfinished():
        out = next((o for o in dense.step() if o.request_id == rid and o.finished), out)
    assert list(out.token_ids) == [int(want.argmax())]


def test_full_attention_solves_retrieval(retrieval, dense_needles, dense):
    lookups = run_samples(dense, retrieval[1])
    accuracy = _accuracy(dense_needles + lookups)
    assert accuracy >= 0.95, f"dense retrieval accuracy {accuracy:.3f}"


@pytest.mark.parametrize("method", ["snapkv", "quest", "omnikv"])
def test_query_aware_methods_at_a_quarter_budget_stay_near_full_attention(method, model_dir, retrieval,
                                                                          dense_needles):
    samples = retrieval[0]
    prompt_len = round(sum(len(s.prompt_ids) for s in samples) / len(samples))
    engine = make_engine(model_dir, method, method_config(method, 0.25, prompt_len))
    accuracy = _accuracy(run_samples(engine, samples))
    assert accuracy >= _accuracy(dense_needles) - 0.05, f"{method} at 25%: {accuracy:.3f}"


def test_streaming_window_that_excludes_the_needle_loses_it(model_dir, retrieval, dense_needles):
    early = [(s, ok) for s, ok in zip(retrieval[0], dense_needles) if s.depth < 0.6]
    samples = [s for s, _ in early]
    prompt_len = max(len(s.prompt_ids) for s in samples)
    config = method_config("streaming_llm", 0.25, prompt_len)
    assert all(s.depth * len(s.prompt_ids) < len(s.prompt_ids) - config["window"] for s in samples)
    streaming = _accuracy(run_samples(make_engine(model_dir, "streaming_llm", config), samples))
    full = _accuracy([ok for _, ok in early])
    assert full >= 0.9 and streaming <= full - 0.5, f"streaming {streaming:.3f} vs full {full:.3f}"


def test_lag_pruning_keeps_recent_rounds_and_loses_pruned_ones(dense):
    rounds, lag = 4, 2
    chains = [tool_chain(dense.tokenizer, random.Random(f"t-lag-{a}-{i}"), rounds, a)
              for a in range(rounds) for i in range(3)]
    assert pruned_rounds(rounds, lag) == [0, 1]
    full = run_lag(dense, chains, None, 1.0, "full")
    kept = run_lag(dense, chains, lag, 0.2, "lag")
    recent = [i for i, c in enumerate(chains) if c.distance <= lag]
    pruned = [i for i, c in enumerate(chains) if c.distance > lag]
    assert _accuracy([full[i] for i in recent]) >= 0.95
    assert _accuracy([kept[i] for i in recent]) >= _accuracy([full[i] for i in recent]) - 0.05
    assert _accuracy([kept[i] for i in pruned]) <= _accuracy([full[i] for i in pruned]) - 0.5


def test_task_generators_are_seeded_and_place_the_fact_at_its_depth(dense):
    tok = dense.tokenizer
    a = needle(tok, random.Random(7), 512, 0.25)
    b = needle(tok, random.Random(7), 512, 0.25)
    assert a.prompt_ids == b.prompt_ids and a.answer_ids == b.answer_ids
    text = tok.decode(a.prompt_ids)
    fact = f"The magic number for {a.meta['key']} is {a.answer}."
    assert text.count(fact) == 1 and text.endswith(f"{a.meta['key']}?\nAnswer:")
    assert abs(len(tok.encode(text[:text.index(fact)])) / len(a.prompt_ids) - 0.25) < 0.1
    assert 480 <= len(a.prompt_ids) <= 560
    chain = tool_chain(tok, random.Random(3), 3, 1)
    lo, hi = chain.round_spans[1]
    assert f'"code": "{chain.sample.answer}"' in tok.decode(chain.sample.prompt_ids[lo:hi])
    assert chain.sample.prompt_ids[:len(chain.history_ids)] == chain.history_ids
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert is_correct(a, a.answer_ids + [end], frozenset({end}))
    assert not is_correct(a, a.answer_ids[:-1] + [end], frozenset({end}))
    assert not is_correct(a, a.answer_ids + a.answer_ids[:1], frozenset({end}))
    with pytest.raises(ValueError, match="depth"):
        needle(tok, random.Random(0), 512, 1.5)


def test_the_server_defaults_to_the_shipped_checkpoint(model_dir):
    from agentrt.app import build_engine
    from agentrt.config import ServerConfig

    engine = build_engine(ServerConfig(engine_options={"device": "cpu", "num_pages": 64}))
    assert engine.config.model == model_dir and (model_dir / "model.safetensors").is_file()
    assert engine.model_config.num_layers == 4 and engine.model_config.vocab_size == 512
