"""``POST /v1/completions`` (OpenAI's legacy text completions) through the official ``openai`` package against a real
uvicorn: the text and log-probabilities are the engine's own for the prompt as given (text or token ids), a stream
assembles to the same result and ends with ``[DONE]``, batches of prompts and ``n`` choices come back in OpenAI's
order, ``echo`` / ``stop`` / ``seed`` behave as documented, the prefix cache serves a repeated prompt, and every
refusal is OpenAI's error object naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from litestar.testing import TestClient
from transformers import AutoTokenizer

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.live_servers import client, model, server  # noqa: F401 (fixtures)
from tests.server_helpers import ENGINE_OPTIONS, bearer, make_engine, make_keys

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(random_model_dir())


@pytest.fixture(scope="module")
def engine():
    return make_engine(random_model_dir())


def _reference(engine, prompt_ids: list[int], max_tokens: int, top: int = 0, **params):
    """The same request on a bare engine (greedy unless ``params`` say otherwise)."""
    from engine import SamplingParams

    params = {"temperature": 0.0, **params}
    rid = engine.add_request(list(prompt_ids), SamplingParams(max_tokens=max_tokens, logprobs=True,
                                                              top_logprobs=top, **params))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the reference request did not finish")


def _sse(lines) -> list[str]:
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


def test_a_completion_is_the_engines_continuation_of_the_prompt(client, model, tokenizer, engine):
    ids = tokenizer.encode(PROMPT)
    ref = _reference(engine, ids, 6)
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.model == model
    [choice] = done.choices
    assert (choice.index, choice.text, choice.logprobs) == (0, ref.text, None)
    assert choice.finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert done.usage.total_tokens == len(ids) + len(ref.token_ids)
    # the same prompt as token ids: the same answer
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == ref.text and by_ids.usage.prompt_tokens == len(ids)
    # OpenAI's default max_tokens: 16
    assert client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 16


def test_a_stream_assembles_to_the_same_completion_and_ends_with_done(client, model, server):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    done = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == done.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    with httpx.Client(base_url=server.url, timeout=60) as http:  # the wire: data events, then [DONE]
        with http.stream("POST", "/v1/completions", json={**kwargs, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            data = _sse(r.iter_lines())
    assert data[-1] == "[DONE]" and all(json.loads(d)["object"] == "text_completion" for d in data[:-1])
    assert all("usage" not in json.loads(d) or json.loads(d)["usage"] is None for d in data[:-1])  # no include_usage


def test_logprobs_are_the_engines_in_the_legacy_form(client, model, tokenizer, engine):
    ids, top = tokenizer.encode(PROMPT), 3
    ref = _reference(engine, ids, 6, top)
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=top)
    lp = done.choices[0].logprobs
    n = len(ref.token_ids)
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    for k in range(n):
        want = {}
        for t, logprob in ref.top_logprobs[k]:
            want.setdefault(tokenizer.decode([t]), logprob)
        assert lp.top_logprobs[k] == pytest.approx(want, abs=1e-4)  # greedy: the sampled token is the first
        assert lp.tokens[k] in lp.top_logprobs[k]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(n)]
    # 0: the sampled token alone at each position; streamed: the same entries
    zero = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    assert [list(d) for d in zero.choices[0].logprobs.top_logprobs] == [[t] for t in lp.tokens]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=top,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_batches_and_n_come_back_in_openais_order(client, model, tokenizer, engine):
    prompts = ["The weather in Paris", "A list of fruits:"]
    done = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        ref = _reference(engine, tokenizer.encode(p), 4)
        assert [done.choices[2 * i + j].text for j in range(2)] == [ref.text, ref.text]  # greedy: alike
    assert done.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)  # each prompt once
    assert done.usage.completion_tokens == 2 * sum(len(_reference(engine, tokenizer.encode(p), 4).token_ids)
                                                   for p in prompts)  # every choice's
    # token-id batches, streamed: each choice's chunks carry its index, each ends with its finish reason
    batch = [tokenizer.encode(p) for p in prompts]
    chunks = list(client.completions.create(model=model, prompt=batch, max_tokens=4, temperature=0, stream=True))
    for i, p in enumerate(prompts):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == _reference(engine, batch[i], 4).text
        assert mine[-1].finish_reason in ("stop", "length") and not any(c.finish_reason for c in mine[:-1])


def test_seed_echo_and_stop(client, model, tokenizer):
    sampled = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0)
    a = client.completions.create(**sampled, seed=11)
    assert client.completions.create(**sampled, seed=11).choices[0].text == a.choices[0].text
    two = client.completions.create(**sampled, seed=11, n=2)  # choice j samples with seed + j
    assert two.choices[0].text == a.choices[0].text
    assert two.choices[1].text == client.completions.create(**sampled, seed=12).choices[0].text

    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ids = tokenizer.encode(PROMPT)
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == tokenizer.decode(ids)  # a token prompt is echoed as its text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text

    said = " the cat sat on the mat"
    forced = tokenizer.encode(said, add_special_tokens=False)
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=len(forced) + 4, stop=["on the"],
                                        extra_body={"forced_token_ids": forced})
    assert stopped.choices[0].text == " the cat sat " and stopped.choices[0].finish_reason == "stop"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client, model):
    prompt = "A long shared preamble about many things. " * 12
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


BAD = [
    ("suffix", {"suffix": "and then"}),
    ("echo", {"echo": True, "logprobs": 1}),
    ("best_of", {"best_of": 2}),
    ("n", {"n": 129}),
    ("n", {"prompt": ["a", "b", "c"], "n": 50}),
    ("prompt", {"prompt": ["a", 1]}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": ""}),
    ("prompt[1]", {"prompt": [1, 10**9]}),
    ("prompt[1][0]", {"prompt": [[1], [10**9]]}),
    ("max_tokens", {"max_tokens": 0}),
    ("logprobs", {"logprobs": 21}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("presence_penalty", {"presence_penalty": -1}),
    ("logit_bias", {"logit_bias": {"12": 5}}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 1.2}}),
    ("temperature", {"temperature": 3}),
    ("stop[0]", {"stop": [""]}),
    ("foo", {"extra_body": {"foo": 1}}),
    ("stream_options.bar", {"stream": True, "stream_options": {"bar": 1}}),
    ("forced_token_ids", {"max_tokens": 1, "extra_body": {"forced_token_ids": [1, 2]}}),
]


@pytest.mark.parametrize("param,kwargs", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_a_refused_request_is_openais_400_naming_the_field(client, model, param, kwargs):
    kwargs = {"prompt": "Hi", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, **kwargs)
    e = err.value
    assert (e.status_code, e.type, e.param) == (400, "invalid_request_error", param), e.body
    assert e.message.startswith(param) or param in e.message
    assert set(e.response.json()["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_are_accepted(client, model):
    done = client.completions.create(model=model, prompt="Hi", max_tokens=2, n=1, best_of=1, frequency_penalty=0,
                                     presence_penalty=0, logit_bias={}, suffix="", user="u1", echo=False,
                                     extra_body={"repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0})
    assert len(done.choices) == 1


def test_other_errors_keep_openais_shape(client, model, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="Hi")
    assert (err.value.param, err.value.code) == ("model", "model_not_found")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and set(r.json()) == {"error"}
        r = http.get("/v1/completions")  # answered by the router, before any route's handlers
        assert r.status_code == 405 and set(r.json()) == {"error"}
        max_len = server.app.state.worker.engine.max_model_len
        r = http.post("/v1/completions", json={"model": model, "prompt": [1] * max_len})
        error = r.json()["error"]
        assert r.status_code == 400 and (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        r = http.post("/v1/completions", json={"model": model, "prompt": "x" * (32 * max_len + 1)})
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"


def test_an_overloaded_engine_is_503_and_leaves_nothing_running(client, model, server):
    worker = server.app.state.worker
    bound, worker.max_queue_depth = worker.max_queue_depth, 1 + len(worker.inflight)
    try:  # the second choice finds the queue full: the first is aborted, the request is a 503
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=model, prompt="Hi", n=2, max_tokens=2)
    finally:
        worker.max_queue_depth = bound
    assert err.value.status_code == 503 and err.value.code == "server_is_overloaded"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert not worker.inflight


def test_a_closed_stream_aborts_its_requests(client, model, server, tokenizer):
    forced = tokenizer.encode(" a b c d e f g h i j k l m n o p", add_special_tokens=False)
    stream = client.completions.create(model=model, prompt=["Hi", "Ho"], max_tokens=len(forced) + 100,
                                       stream=True, extra_body={"forced_token_ids": forced, "ignore_eos": True})
    next(iter(stream))
    stream.close()
    worker = server.app.state.worker
    deadline = time.monotonic() + 30
    while worker.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.inflight


def test_the_key_is_required_when_auth_is_on(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'auth.db'}"
    auth = bearer(make_keys(db_url, "alice")["alice"])
    config = ServerConfig(model=random_model_dir(), model_name="tiny", db_url=db_url, engine_options=ENGINE_OPTIONS,
                          require_auth=True, max_tokens_per_turn=8)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "ignore_eos": True}, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8  # min(16, the server's limit)
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 9, "ignore_eos": True},
                   headers=auth)  # over the limit (8): lowered to it
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
