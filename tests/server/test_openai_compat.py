"""The OpenAI-compatible route as the official ``openai`` package and litellm see it, against a real uvicorn:
OpenAI's error object (400s naming the field, 401, 404, 503), every request field honored, accepted or
refused, streamed tool calls assembled by the clients equal to the non-streamed ones (no markup as content),
and ``logprobs`` / ``top_logprobs`` equal to the engine's own for the same request. Plus the incremental
tool-call parser against agentrt.chat's rules on random splits of random texts."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient
from transformers import AutoTokenizer

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.tool_syntax import ToolCallReader, by_name
from engine.tiny_checkpoint import random_model_dir
from tests.live_servers import client, model, server  # noqa: F401 (fixtures)
from tests.server_helpers import ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL, make_engine

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

ASK = [{"role": "user", "content": "Weather in Paris?"}]
SECOND_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


# --- the incremental parser ------------------------------------------------------------------------
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "<", ">", "{", "}", '"', " ", "\n", "\t",
             "Hi", " there", "é", '{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}', '{"arguments": {}}',
             '{"name": 3}', "{not json}", '{"name": "h", "arguments": "raw"}', TOOL_CALL, SECOND_CALL]


def _run(pieces: list[str]) -> tuple[list[str], list]:
    parser, released, calls = HERMES.stream(), [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        released.append(text)
        calls += new
    text, new = parser.finish()
    return released + [text], calls + new


def _named(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.data())
def test_tool_call_stream_equals_the_whole_text_rules_on_any_split(fragments, data):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    released, calls = _run(pieces)
    assert "".join(released) == HERMES.reply_content(text)
    assert _named(calls) == _named(HERMES.reply_calls(text))


def test_tool_call_stream_releases_text_as_soon_as_it_is_decided():
    parser = HERMES.stream()
    assert parser.feed("  Let me") == ("Let me", [])  # leading whitespace: strip() would drop it
    assert parser.feed(" check. <tool") == (" check.", [])  # the trailing space and a partial tag wait
    assert parser.feed("_call>\n{\"name\": \"get_weather\", ") == ("", [])  # a call may be coming
    text, calls = parser.feed('"arguments": {"city": "Paris"}}\n</tool_call>\n')
    assert text == "" and _named(calls) == [("get_weather", '{"city": "Paris"}')]  # complete: out at once
    assert parser.feed("<tool_call> not a call") == (" \n<tool_call> not a call", [])  # held space, then on
    assert parser.finish() == ("", [])
    assert _run(["<tool_call>{unfinished"])[0] == ["", "<tool_call>{unfinished"]  # released only at the end


# --- the live server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(random_model_dir())


def _forced(tokenizer, text: str) -> list[int]:
    """Token ids that make the model say ``text`` and then stop (its end-of-turn token, forced as well)."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


BAD_REQUESTS = [
    ("temperature", {"temperature": 3}),
    ("foo", {"extra_body": {"foo": 1}}),
    ("messages[0].bar", {"messages": [{"role": "user", "content": "x", "bar": 1}]}),
    ("messages[0].role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("tool_choice", {"tool_choice": "required"}),  # no tools to call
    ("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}),
    ("tool_choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}),
    ("tools[0].function.parameters", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}),
    ("response_format", {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "strin"}}}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
    ("response_format", {"response_format": {"type": "xml"}}),
    ("n", {"n": 2}),
    ("functions", {"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]}),
    ("function_call", {"function_call": "auto"}),
    ("logit_bias", {"logit_bias": {"12": 5}}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("presence_penalty", {"presence_penalty": -1}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("reasoning_effort", {"reasoning_effort": "extreme"}),  # not a level (a level is no effect on this model)
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    ("messages[0].role", {"messages": [{"role": "function", "name": "get_weather", "content": "{}"}]}),
]


@pytest.mark.parametrize("param,kwargs", BAD_REQUESTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_REQUESTS)])
def test_a_refused_request_is_openais_400_naming_the_field(client, model, param, kwargs):
    kwargs = {"messages": ASK, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, **kwargs)
    e = err.value
    assert (e.status_code, e.type, e.param) == (400, "invalid_request_error", param), e.body
    assert param in str(e) and param in e.message
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_and_other_errors_keep_openais_shape(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=ASK)
    assert (err.value.param, err.value.code, err.value.type) == ("model", "model_not_found", "not_found_error")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get(f"/v1/models/{client.models.list().data[0].id}").json()["object"] == "model"
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.get("/v1/chat/completions")  # answered by the router, before any route's handlers
        assert r.status_code == 405 and set(r.json()) == {"error"}
        r = http.get("/v1/chains/chain_nope")  # the chain routes keep their own shape
        assert r.status_code == 404 and set(r.json()) == {"status_code", "detail"}


def test_an_overloaded_engine_is_503_in_openais_shape(client, model, server):
    worker = server.app.state.worker
    bound, worker.max_queue_depth = worker.max_queue_depth, 0
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    finally:
        worker.max_queue_depth = bound
    assert err.value.status_code == 503 and err.value.code == "server_is_overloaded"
    assert err.value.type == "service_unavailable_error" and int(err.value.response.headers["retry-after"]) >= 1


def test_an_error_after_the_stream_started_arrives_as_openais_error_event(client, model, server, tokenizer):
    engine = server.app.state.worker.engine
    real, steps = engine.step, []

    def failing():
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("the device fell over")
        return real()

    engine.step = failing  # the worker thread's next steps fail: every request in flight fails
    received = []
    forced = tokenizer.encode("a b c d e f g h i j k l", add_special_tokens=False)  # no early end of turn
    try:
        with pytest.raises(openai.APIError) as err:
            for chunk in client.chat.completions.create(model=model, messages=ASK, max_tokens=40, stream=True,
                                                        extra_body={"forced_token_ids": forced}):
                received.append(chunk)
    finally:
        del engine.step
    assert received and not isinstance(err.value, openai.APIStatusError)  # the response had started (200)
    assert err.value.type == "server_error" and "RuntimeError" in err.value.message
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices  # still serving


def test_missing_key_is_401_in_openais_shape_on_the_openai_routes_only(tmp_path):
    config = ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{tmp_path / 'auth.db'}",
                          engine_options=ENGINE_OPTIONS, require_auth=True)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        for r in (c.post("/v1/chat/completions", json={"model": "x", "messages": ASK}),
                  c.post("/v1/chat/completions", content=b"{not json"),  # checked before the body is read
                  c.get("/v1/models")):
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            error = r.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert "API key" in error["message"]
        r = c.get("/v1/chains")
        assert r.status_code == 401 and r.json()["status_code"] == 401


def test_accepted_fields_without_effect_change_nothing(client, model):
    base = dict(model=model, messages=ASK, temperature=0, max_tokens=6)
    plain = client.chat.completions.create(**base)
    extras = dict(user="u1", safety_identifier="s1", metadata={"k": "v"}, store=False, service_tier="auto",
                  parallel_tool_calls=True, prompt_cache_key="key", frequency_penalty=0, presence_penalty=0,
                  logit_bias={}, response_format={"type": "text"}, modalities=["text"], n=1, reasoning_effort="none",
                  prediction={"type": "content", "content": "hello"}, max_completion_tokens=6)
    same = client.chat.completions.create(**base, **extras)
    assert same.choices[0].message.content == plain.choices[0].message.content
    streamed = list(client.chat.completions.create(**base, stream=True, stream_options={
        "include_usage": True, "include_obfuscation": False}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        (plain.choices[0].message.content or "")
    assert streamed[-1].usage.completion_tokens == plain.usage.completion_tokens


def _assembled(client, **kwargs):
    """The client's own accumulation of a stream (``ChatCompletionStreamState``), and the raw chunks."""
    chunks = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        final = stream.get_final_completion()
    return final, chunks


def _calls(message) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


@pytest.mark.parametrize("said", [TOOL_CALL, f"Let me check.\n{TOOL_CALL}\n{SECOND_CALL}\nOne moment.",
                                  "  No call, just text.  "])
def test_a_streamed_tool_call_assembles_to_the_non_streamed_message(client, model, tokenizer, said):
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER_TOOL], temperature=0, max_tokens=200,
                  extra_body={"forced_token_ids": _forced(tokenizer, said)})
    done = client.chat.completions.create(**kwargs)
    message, finish = done.choices[0].message, done.choices[0].finish_reason
    assert message.content == (HERMES.reply_content(said) or None)
    assert _calls(message) == _named(HERMES.reply_calls(said))
    assert finish == ("tool_calls" if message.tool_calls else "stop")

    final, chunks = _assembled(client, **kwargs)
    got = final.choices[0]
    assert got.message.content == message.content and _calls(got.message) == _calls(message)
    assert got.finish_reason == finish
    assert len({t.id for t in got.message.tool_calls or []}) == len(message.tool_calls or [])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("<tool_call>" in (d.content or "") or "get_weather" in (d.content or "") for d in deltas)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == finish and not any(finishing[:-1])
    assert chunks[-1].choices[0].delta.content is None and chunks[-1].choices[0].delta.tool_calls is None
    for d in deltas:
        for t in d.tool_calls or []:  # each call whole in one delta: index, id, type, name, arguments
            assert t.id.startswith("call_") and t.type == "function" and t.function.name == "get_weather"


def test_tool_choice_none_leaves_the_text_as_generated(client, model, tokenizer):
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none", temperature=0,
                  max_tokens=100, extra_body={"forced_token_ids": _forced(tokenizer, TOOL_CALL)})
    done = client.chat.completions.create(**kwargs)
    assert done.choices[0].message.content == TOOL_CALL and done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TOOL_CALL


def test_streamed_tool_calls_on_a_chain_carry_the_chains_ids(client, model, server, tokenizer):
    def chain() -> str:
        r = httpx.post(server.url + "/v1/chains", json={"tools": [WEATHER_TOOL]}, timeout=60)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    said = f"On it.\n{TOOL_CALL}"
    kwargs = dict(model=model, messages=ASK, temperature=0, max_tokens=100)
    forced = _forced(tokenizer, said)
    done = client.chat.completions.create(**kwargs, extra_body={"chain_id": chain(), "forced_token_ids": forced})
    cid = chain()
    final, chunks = _assembled(client, **kwargs, extra_body={"chain_id": cid, "forced_token_ids": forced})
    assert final.choices[0].message.content == done.choices[0].message.content == "On it."
    assert _calls(final.choices[0].message) == _calls(done.choices[0].message) == _named(HERMES.reply_calls(said))
    assert final.choices[0].finish_reason == done.choices[0].finish_reason == "tool_calls"
    kept = httpx.get(f"{server.url}/v1/chains/{cid}", timeout=60).json()["turns"][0]["message"]["tool_calls"]
    assert [t.id for t in final.choices[0].message.tool_calls] == [t["id"] for t in kept]
    # the history as returned (markup stripped, calls apart) continues the chain
    history = [*ASK, final.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
               {"role": "tool", "tool_call_id": kept[0]["id"], "content": '{"temp_c": 18}'}]
    more = client.chat.completions.create(model=model, messages=history, max_tokens=2, extra_body={"chain_id": cid})
    assert more.model_extra["chain"]["turn"] == 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs, logprobs=True, extra_body={"chain_id": cid})
    assert err.value.param == "logprobs"


def _reference(tokenizer, messages, max_tokens: int, top: int):
    """The same request on a bare engine: the prompt as the server renders it, greedy, with logprobs."""
    from engine import SamplingParams

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine = make_engine(random_model_dir())
    rid = engine.add_request(tokenizer.encode(text, add_special_tokens=False),
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True, top_logprobs=top,
                                            ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the reference request did not finish")


def test_logprobs_are_the_engines_and_stream_alike(client, model, tokenizer):
    messages = [{"role": "user", "content": "Count the log-probabilities, please."}]
    top, n = 5, 8
    ref = _reference(tokenizer, messages, n, top)
    kwargs = dict(model=model, messages=messages, temperature=0, max_tokens=n, logprobs=True, top_logprobs=top)
    done = client.chat.completions.create(**kwargs)
    entries = done.choices[0].logprobs.content
    if done.choices[0].finish_reason == "stop":  # the model ended the turn early: compare what it generated
        n = len(entries)
    assert len(entries) == n == done.usage.completion_tokens and n >= 2
    assert [tokenizer.decode([t]) for t in ref.token_ids[:n]] == [e.token for e in entries]
    assert [e.logprob for e in entries] == pytest.approx(ref.logprobs[:n], abs=1e-4)
    for entry, want in zip(entries, ref.top_logprobs[:n]):
        assert len(entry.top_logprobs) == top
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in want]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([lp for _, lp in want], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token is the one chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_logprob_bytes_spell_the_content(client, model, tokenizer):
    said = "Déjà vu: 18°C in Paris ☀"
    done = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=100, logprobs=True,
                                          extra_body={"forced_token_ids": _forced(tokenizer, said)})
    entries = done.choices[0].logprobs.content
    assert entries[-1].token == "<|im_end|>" and all(e.top_logprobs == [] for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries[:-1]).decode() == said == done.choices[0].message.content
    assert all(e.logprob <= 0 for e in entries)


# --- litellm -----------------------------------------------------------------------------------------
def test_litellm_surfaces_the_reason_and_assembles_streamed_tool_calls(server, model, tokenizer):
    import litellm

    common = dict(model=f"openai/{model}", api_base=server.url + "/v1", api_key="unused", max_retries=0)
    nope = {"type": "function", "function": {"name": "nope"}}
    for kwargs, words in (({"tool_choice": nope, "tools": [WEATHER_TOOL]}, ("tool_choice", "not among the tools")),
                          ({"n": 2}, ("n", "one choice")),
                          ({"foo": 1}, ("foo", "Unrecognized request argument"))):
        with pytest.raises(litellm.BadRequestError) as err:
            litellm.completion(messages=ASK, max_tokens=2, **common, **kwargs)
        assert all(w in str(err.value) for w in words), str(err.value)

    said = f"Checking.\n{TOOL_CALL}"
    kwargs = dict(messages=ASK, tools=[WEATHER_TOOL], temperature=0, max_tokens=100,
                  extra_body={"forced_token_ids": _forced(tokenizer, said)}, **common)
    done = litellm.completion(**kwargs)
    chunks = list(litellm.completion(**kwargs, stream=True))
    built = litellm.stream_chunk_builder(chunks, messages=ASK)
    for response in (done, built):
        message = response.choices[0].message
        assert message.content == "Checking." and response.choices[0].finish_reason == "tool_calls"
        assert _calls(message) == [("get_weather", '{"city": "Paris"}')]
