"""The engine's public API: errors for bad input, sampling options end to end, the step-level API."""

import json
import shutil

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.errors import (CheckpointError, ConfigError, InvalidRequestError, InvalidSamplingParamsError,
                           UnsupportedArchitectureError)
from tests.hf_reference import hf_greedy, hf_token_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm("llama", max_model_len=512, num_pages=24)


def run_to_end(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_bad_requests_raise_typed_errors_and_engine_keeps_serving(llm, tiny_dirs):
    engine = llm.engine
    prompt = [5, 6, 7, 8, 9, 10]
    good = engine.add_request(prompt, GREEDY)
    cases = [
        ("", GREEDY, InvalidRequestError, "empty"),
        ([], GREEDY, InvalidRequestError, "empty"),
        ([5] * 513, GREEDY, InvalidRequestError, "max_model_len"),
        ([1, 2, 10**6], GREEDY, InvalidRequestError, "token id"),
        ([1, 2, -1], GREEDY, InvalidRequestError, "token id"),
        (42, GREEDY, InvalidRequestError, "prompt must be"),
        ([1, 2, 3], {"temperature": 0}, InvalidSamplingParamsError, "SamplingParams"),
        ([1, 2, 3], SamplingParams(max_tokens=5000), InvalidRequestError, "pages"),
    ]
    for prompt_bad, params, exc, words in cases:
        with pytest.raises(exc, match=words):
            engine.add_request(prompt_bad, params)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(prompt, GREEDY, request_id=good)
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1.0)
    outs = run_to_end(engine)
    assert list(outs) == [good]
    eos = sorted(engine.model_config.eos_token_ids)
    assert outs[good][-1].token_ids == hf_greedy(tiny_dirs["llama"], prompt, 12, eos)


def test_bad_checkpoints_and_config_raise_typed_errors(tiny_dirs, tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        LLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dirs["qwen2"], broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError):
        LLM(broken)
    alien = tmp_path / "alien"
    shutil.copytree(tiny_dirs["qwen2"], alien)
    cfg = json.loads((alien / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (alien / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM"):
        LLM(alien)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_dirs["qwen2"], no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(no_weights)
    with pytest.raises(ConfigError, match="page_sise"):
        LLM(tiny_dirs["qwen2"], page_sise=16)
    with pytest.raises(ConfigError, match="unknown method"):
        LLM(tiny_dirs["qwen2"], method="no-such-method")
    with pytest.raises(ConfigError, match="no option"):
        LLM(tiny_dirs["qwen2"], method_config={"budget": 4})
    with pytest.raises(ConfigError, match="page_size"):
        EngineConfig(model="x", page_size=0)


def test_stop_token_ids_stop_strings_ignore_eos_and_length(llm):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12

    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True))[0]
    assert out.text == text[: cut + len(stop)]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    prompt = [21, 22, 23, 24]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = [[30 + i, 31, 32] for i in range(5)]
    batch = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=7)] * 2 + [seeded]
                         + [SamplingParams(temperature=0.7, max_tokens=3)] * 3)
    assert batch[2].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_logprobs_match_hf_log_softmax(llm, tiny_dirs):
    prompt = [40, 41, 42, 43, 44]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, max_tokens=6, seed=5, logprobs=True,
                                                ignore_eos=True))[0]
    ref = hf_token_logprobs(tiny_dirs["llama"], prompt, out.token_ids)
    assert out.logprobs == pytest.approx(ref, abs=1e-4)


def test_step_api_streams_deltas_and_abort_frees_pages(llm):
    engine = llm.engine
    a = engine.add_request([50, 51, 52, 53], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    b = engine.add_request([60, 61, 62] * 10, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    outs: dict[str, list] = {}
    for _ in range(4):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    aborted = engine.abort(b)
    assert aborted.finished and aborted.finish_reason == "abort"
    assert engine.abort(b) is None
    rest = run_to_end(engine)
    stream = outs[a] + rest.get(a, [])
    final = stream[-1]
    assert final.finished and final.finish_reason == "length"
    assert [t for o in stream for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in stream) == final.text
    assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert all(engine.pool.ref_counts[p] == 0 for p in range(engine.pool.num_pages))


def test_forced_decoding_emits_the_given_tokens_with_the_model_logprobs(llm, tiny_dirs):
    prompt = [70, 71, 72, 73, 74]
    forced = [9, 300, 12, 45]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True,
                                                logprobs=True, forced_token_ids=forced))[0]
    assert out.token_ids[:4] == forced and len(out.token_ids) == 6
    assert out.logprobs == pytest.approx(hf_token_logprobs(tiny_dirs["llama"], prompt, out.token_ids), abs=1e-4)
    greedy_after = llm.generate([prompt + forced], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    forced_then_greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                forced_token_ids=forced))[0]
    assert forced_then_greedy.token_ids[4:] == greedy_after[0].token_ids
    with pytest.raises(InvalidSamplingParamsError, match="forced_token_ids"):
        llm.engine.add_request(prompt, SamplingParams(forced_token_ids=[10**6]))
    with pytest.raises(InvalidSamplingParamsError, match="forced_token_ids"):
        SamplingParams(forced_token_ids=[-1])


def test_cached_page_rows_follow_the_tables_as_they_grow(make_llm):
    """The int32 page row a table caches for building block tables is extended, not rebuilt, when decode steps
    allocate pages; after every step it equals the table's page list (prefix hits and a fork included)."""
    engine = make_llm("llama", page_size=4, max_num_batched_tokens=32, num_pages=128).engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = list(range(10, 40))
    for prompt in (base, base + [7, 8, 9], list(range(50, 61))):
        engine.add_request(prompt, params)
    cache, checked = engine.cache, 0
    while engine.has_unfinished():
        engine.step()
        for t in cache._tables.values():
            if t.host_row is not None:
                assert t.host_row.tolist() == t.pages
                checked += 1
    assert checked > 20
