"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` package against a real uvicorn with auth on (two tenants' keys, sent as ``x-api-key``), on the
embedded model.

The client re-sends the whole conversation every time; the server resumes the conversation's implicit chain.
References: the chain's turns, token log, regions and KV counters read back over the chain API with the same
key (what the engine prefilled and resumed), and the ``agentrt-chain-id`` / ``agentrt-chain-resolution``
headers naming the chain that served each request. Tool calls are forced with the test extension
``agentrt_forced_token_ids`` (the model then emits exactly that markup), or by ``tool_choice`` ``any`` / ``tool``
(constrained decoding: the model never calls a tool by itself). Plus the block writer against
agentrt.chat's rules on random splits of random texts (no server)."""

from __future__ import annotations

import asyncio
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validate

from agentrt.anthropic_events import BlockWriter, Pending
from agentrt.anthropic_messages import MessagesService
from agentrt.anthropic_types import TextBlock, ToolUseBlock
from agentrt.engine_worker import EngineUnavailable
from agentrt.implicit_chains import Resolved
from agentrt.tool_syntax import ToolCallReader, by_name
from sdk.schema import TurnDelta
from tests.live_servers import app_server
from tests.server_helpers import TOOL_CALL, bearer, sse_events
from tests.tenant_servers import db_url, http, keys, server, tokens  # noqa: F401 (fixtures)

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SEARCH = {"name": "search", "description": "Search the web",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                                            "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
                           "required": ["query", "limit"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # this SDK no longer types the sampling fields; the API still takes them
END = "<|im_end|>"


# --- the block writer (no server) ----------------------------------------------------------------------------
SECOND_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "<", ">", "{", "}", '"', " ", "\n",
             "Hi", " there", "é", '{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}', "{not json}",
             '{"name": "h", "arguments": "raw"}', TOOL_CALL, SECOND_CALL]


def _blocks(pieces: list[str]) -> list:
    writer = BlockWriter(HERMES)
    events = [e for p in pieces for e in writer.feed(p)] + writer.finish()
    built: list = []  # the blocks as a client assembles them from the events
    for e in events:
        if type(e).__name__ == "ContentBlockStartEvent":
            built.append(copy.deepcopy(e.content_block))
        elif type(e).__name__ == "ContentBlockDeltaEvent":
            if isinstance(built[e.index], TextBlock):
                built[e.index].text += e.delta.text
            else:
                built[e.index].input = json.loads(e.delta.partial_json)
    assert [_key(b) for b in built] == [_key(b) for b in writer.blocks]
    return writer.blocks


def _key(block) -> tuple:
    return ("text", block.text) if isinstance(block, TextBlock) else ("tool_use", block.name, block.input)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.data())
def test_blocks_do_not_depend_on_how_the_text_was_cut(fragments, data):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, split = _blocks([text]), _blocks(pieces)
    assert [_key(b) for b in split] == [_key(b) for b in whole]
    assert "".join(b.text for b in whole if isinstance(b, TextBlock)) == HERMES.reply_content(text)
    calls = [(c.function.name, c.function.arguments) for c in HERMES.reply_calls(text)]
    assert [b.name for b in whole if isinstance(b, ToolUseBlock)] == [name for name, _ in calls]
    assert all(b.text for b in whole if isinstance(b, TextBlock))  # no empty text block


class _FailingTurn:
    """A turn whose engine goes away after its first token."""

    state = SimpleNamespace(token_ids=[], num_turns=0)
    prompt = [1, 2, 3]

    async def events(self):
        yield TurnDelta(text="Hi", token_ids=[1])
        raise EngineUnavailable("the engine worker is not running")

    async def close(self) -> None:
        pass


def test_an_error_in_a_started_stream_is_an_error_event_the_client_raises():
    pending = Pending(id="msg_1", turn=_FailingTurn(), resolved=Resolved(chain_id="c", offset=0, how="created",
                                                                         state=None), calls=HERMES, prefix=None,
                      stop_sequences=[])

    async def collect() -> bytes:
        service = MessagesService(None, None, "m", None)  # the stream needs none of them
        return b"".join([_encode(m) async for m in service.events(pending)])

    anthropic_httpx = pytest.importorskip("httpx2")  # the anthropic package's HTTP client
    body = asyncio.run(collect())
    events = sse_events(body.decode().splitlines())
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "the engine worker is not running"}}
    transport = anthropic_httpx.MockTransport(lambda request: anthropic_httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                                 http_client=anthropic_httpx.Client(transport=transport))
    with pytest.raises(anthropic.APIStatusError) as err:
        for _ in client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                        stream=True):
            pass
    assert err.value.body["error"]["type"] == "overloaded_error"


def _encode(message) -> bytes:
    return f"event: {message.event}\ndata: {message.data}\n\n".encode()


# --- the server (tests.tenant_servers), its tenants on the anthropic client ----------------------------------
@pytest.fixture(scope="module")
def alice(server, keys):
    return anthropic.Anthropic(base_url=server.url, api_key=keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def bob(server, keys):
    return anthropic.Anthropic(base_url=server.url, api_key=keys["bob"], max_retries=0)


@pytest.fixture(scope="module")
def model():
    return "qwen3-tiny"  # the embedded model's name


def _chain(http, key, chain_id) -> dict:
    r = http.get(f"/v1/chains/{chain_id}?include_tokens=true", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _ask(client, model, messages, **kw):
    """(message, chain id, resolution) of a non-streamed request."""
    extra = {**GREEDY, **kw.pop("extra_body", {})}
    raw = client.messages.with_raw_response.create(model=model, max_tokens=kw.pop("max_tokens", 6),
                                                   messages=messages, extra_body=extra, **kw)
    return raw.parse(), raw.headers["agentrt-chain-id"], raw.headers["agentrt-chain-resolution"]


def _stream(client, model, messages, **kw):
    extra = {**GREEDY, **kw.pop("extra_body", {})}
    with client.messages.stream(model=model, max_tokens=kw.pop("max_tokens", 6), messages=messages,
                                extra_body=extra, **kw) as s:
        message = s.get_final_message()
        return message, s.response.headers["agentrt-chain-id"], s.response.headers["agentrt-chain-resolution"]


def _returned(message) -> dict:
    """The assistant message as a client appends it to its history."""
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True, exclude={"parsed_output"})
                                             for b in message.content]}


def _comparable(message) -> dict:
    """The message less its id and tool-use ids, and with the prompt's size rather than its split into computed
    and reused tokens (a second conversation with the same start reads the first's prompt from the prefix cache)."""
    body = message.model_dump(exclude={"id"}, exclude_none=True)
    used = body.pop("usage")
    body["prompt_tokens"] = used["input_tokens"] + used["cache_read_input_tokens"]
    body["output_tokens"] = used["output_tokens"]
    for block in body["content"]:
        block.pop("parsed_output", None)
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return body


def _conversation(send, model, tokens, user: str) -> tuple[list, list, list]:
    """A three-request tool-using conversation through ``send`` (non-streamed or streamed): the question answered
    with a forced tool call, the tool's result, a follow-up. Returns the messages, chain ids and resolutions."""
    forced = tokens(TOOL_CALL + END)
    history: list = [{"role": "user", "content": "Weather in Paris?"}]
    meta = {"user_id": user}
    first, cid, how = send(model, history, tools=[WEATHER], metadata=meta, max_tokens=len(forced),
                           extra_body={"agentrt_forced_token_ids": forced})
    (call,) = [b for b in first.content if b.type == "tool_use"]
    history += [_returned(first), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp_c": 18}'}]}]
    second, cid2, how2 = send(model, history, tools=[WEATHER], metadata=meta)
    history += [_returned(second), {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    third, cid3, how3 = send(model, history, tools=[WEATHER], metadata=meta)
    return [first, second, third], [cid, cid2, cid3], [how, how2, how3]


def test_tool_use_conversation_resumes_its_chain_streamed_or_not(alice, http, keys, model, tokens):
    sent, ids, hows = _conversation(lambda *a, **k: _ask(alice, *a, **k), model, tokens, "session-plain")
    first, second, third = sent
    (call,) = first.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert hows == ["created", "resumed", "resumed"] and len(set(ids)) == 1
    chain = _chain(http, keys["alice"], ids[0])
    assert chain["num_turns"] == 3 and chain["metadata"]["agentrt_implicit"]["session"] is not None
    turn1 = chain["turns"][1]
    assert turn1["messages"] == [{"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": call.id,
                                  "name": "get_weather"}]
    assert chain["turns"][2]["messages"] == [{"role": "user", "content": "And tomorrow?"}]
    for message, turn in zip(sent, chain["turns"]):
        used = turn["usage"]
        assert message.usage.input_tokens == used["prefilled_tokens"]
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == used["prompt_tokens"]
        assert message.usage.output_tokens == used["completion_tokens"]
        assert message.usage.cache_creation_input_tokens == 0
    assert sent[0].usage.cache_read_input_tokens == 0
    for message, turn in zip(sent[1:], chain["turns"][1:]):
        assert turn["resume_status"] == "resumed"
        assert message.usage.cache_read_input_tokens > 0
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1  # only the new part
    # the same conversation streamed (its own session): the client's assembled messages are the same
    streamed, sids, shows = _conversation(lambda *a, **k: _stream(alice, *a, **k), model, tokens, "session-streamed")
    assert shows == ["created", "resumed", "resumed"] and len(set(sids)) == 1 and sids[0] != ids[0]
    assert [_comparable(m) for m in streamed] == [_comparable(m) for m in sent]


def test_stream_events_in_anthropics_order(http, keys, model, tokens):
    forced = tokens("Sure." + TOOL_CALL + END)
    body = {"model": model, "max_tokens": len(forced), "stream": True, "tools": [WEATHER], "temperature": 0,
            "agentrt_forced_token_ids": forced, "messages": [{"role": "user", "content": "Order?"}]}
    with http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": keys["alice"]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert all(name == data["type"] for name, data in events)
    names = [name for i, (name, _) in enumerate(events) if i == 0 or name != events[i - 1][0]]  # deltas collapsed
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    blocks = [data for name, data in events if name == "content_block_start"]
    assert blocks[0] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": "", "citations": None}}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["index"] == 0) == "Sure."
    assert blocks[1]["index"] == 1 and blocks[1]["content_block"]["name"] == "get_weather"
    (json_delta,) = [d for n, d in events if n == "content_block_delta" and d["index"] == 1]
    assert json_delta["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == len(forced)


def test_interleaved_conversations_never_resume_each_others_chain(alice, http, keys, model):
    a: list = [{"role": "user", "content": "First conversation."}]
    b: list = [{"role": "user", "content": "Second conversation."}]
    chains: dict[str, set] = {"a": set(), "b": set()}
    for step in range(3):
        for name, history in (("a", a), ("b", b)):
            message, cid, how = _ask(alice, model, history)
            assert how == ("created" if step == 0 else "resumed")
            chains[name].add(cid)
            history += [_returned(message), {"role": "user", "content": f"{name} step {step}"}]
    assert len(chains["a"]) == len(chains["b"]) == 1 and chains["a"] != chains["b"]
    for name, history in (("a", a), ("b", b)):
        chain = _chain(http, keys["alice"], next(iter(chains[name])))
        assert [m["content"] for t in chain["turns"] for m in t["messages"]] == \
            [m["content"] for m in history[:-1] if m["role"] == "user"]
    # identical conversations told apart by their session keys (metadata.user_id)
    same: dict[str, list] = {"s1": [{"role": "user", "content": "Same words."}],
                             "s2": [{"role": "user", "content": "Same words."}]}
    seen: dict[str, set] = {"s1": set(), "s2": set()}
    for step in range(2):
        for session, history in same.items():
            message, cid, _ = _ask(alice, model, history, metadata={"user_id": session})
            seen[session].add(cid)
            history += [_returned(message), {"role": "user", "content": "Again."}]
    assert len(seen["s1"]) == len(seen["s2"]) == 1 and seen["s1"] != seen["s2"]


def test_another_tenant_never_resumes_the_chain(alice, bob, http, keys, model, server):
    history: list = [{"role": "user", "content": "Tenant-scoped prefix."}]
    message, alice_chain, _ = _ask(alice, model, history)
    history += [_returned(message), {"role": "user", "content": "Go on."}]
    _, bob_chain, how = _ask(bob, model, history)
    assert how == "created" and bob_chain != alice_chain  # bob's history is imported into a chain of his own
    assert http.get(f"/v1/chains/{bob_chain}", headers=bearer(keys["alice"])).status_code == 404
    assert http.get(f"/v1/chains/{alice_chain}", headers=bearer(keys["bob"])).status_code == 404
    assert _chain(http, keys["alice"], alice_chain)["num_turns"] == 1  # untouched
    _, again, how = _ask(alice, model, history)
    assert (again, how) == (alice_chain, "resumed")
    stranger = anthropic.Anthropic(base_url=server.url, api_key="art_0123456789abcdef_" + "x" * 43, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        stranger.messages.create(model=model, max_tokens=2, messages=history)
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "invalid or revoked API key"}}
    r = http.post("/v1/messages", json={"model": model, "max_tokens": 2, "messages": history})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in r.json()["error"]["message"] and r.headers["www-authenticate"].startswith("Bearer")
    # two different keys in x-api-key and Authorization are refused
    r = http.post("/v1/messages", headers={"x-api-key": keys["alice"], **bearer(keys["bob"])},
                  json={"model": model, "max_tokens": 2, "messages": history})
    assert r.status_code == 401 and "two different API keys" in r.json()["error"]["message"]
    # the same key as a bearer token works too
    r = http.post("/v1/messages", headers=bearer(keys["bob"]),
                  json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["agentrt-chain-id"] != alice_chain


def test_a_retried_request_forks_and_a_busy_chain_is_left_alone(alice, http, keys, model, server):
    history: list = [{"role": "user", "content": "Retry me."}]
    message, cid, _ = _ask(alice, model, history)
    history += [_returned(message), {"role": "user", "content": "Second question."}]
    _, resumed, how = _ask(alice, model, history)
    assert (resumed, how) == (cid, "resumed")
    # the client sends the same request again (a retry): the chain moved on, so a fork of its first turn serves it
    retry, forked, how = _ask(alice, model, history)
    assert how == "forked" and forked != cid and retry.usage.cache_read_input_tokens > 0
    fork = _chain(http, keys["alice"], forked)
    assert fork["parent_id"] == cid and fork["num_turns"] == 2 and fork["turns"][1]["resume_status"] == "resumed"
    assert _chain(http, keys["alice"], cid)["num_turns"] == 2  # the original is intact
    # a chain with a turn in flight is not resumed: the request gets a chain of its own
    history += [_returned(retry), {"role": "user", "content": "Third."}]
    chains = server.app.state.chains
    chains.busy.update((cid, forked))  # both hold this history (greedy decoding: the same reply)
    try:
        _, other, how = _ask(alice, model, history)
    finally:
        chains.busy.difference_update((cid, forked))
    assert other not in (cid, forked) and how == "created"
    assert _chain(http, keys["alice"], forked)["num_turns"] == 2 and _chain(http, keys["alice"], cid)["num_turns"] == 2
    statuses = [t["resume_status"] for t in _chain(http, keys["alice"], other)["turns"]]
    assert statuses == ["created", "resumed", "resumed"]  # the history imported turn by turn, then the new one


def test_concurrent_requests_of_one_conversation_never_share_a_chain(alice, model):
    history: list = [{"role": "user", "content": "Parallel requests."}]
    message, cid, _ = _ask(alice, model, history)
    history += [_returned(message), {"role": "user", "content": "Both at once."}]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: _ask(alice, model, history), range(2)))
    hows = sorted(how for _, _, how in answers)
    assert len({chain for _, chain, _ in answers}) == 2 and cid in {chain for _, chain, _ in answers}
    assert hows in (["created", "resumed"], ["forked", "resumed"])  # the other one waited for nothing


def test_a_history_from_elsewhere_is_imported_then_resumed(alice, http, keys, model):
    history: list = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_elsewhere", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_elsewhere", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]}]}]
    message, cid, how = _ask(alice, model, history, tools=[WEATHER])
    assert how == "created"
    chain = _chain(http, keys["alice"], cid)
    imported, turn = chain["turns"]
    assert imported["assistant_prefix"] == ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                            '{"city": "Rome"}}\n</tool_call>')
    assert imported["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turn["messages"] == [{"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_elsewhere",
                                 "name": "get_weather"}]
    assert message.usage.input_tokens == imported["usage"]["prefilled_tokens"] + turn["usage"]["prefilled_tokens"]
    history += [_returned(message), {"role": "user", "content": "Thanks."}]
    again, cid2, how = _ask(alice, model, history, tools=[WEATHER])
    assert (cid2, how) == (cid, "resumed") and again.usage.cache_read_input_tokens > 0


def test_stop_sequence_max_tokens_and_prefill(alice, http, keys, model, tokens):
    forced = tokens("Alpha STOP beta")
    message, cid, _ = _ask(alice, model, [{"role": "user", "content": "Spell."}], stop_sequences=["STOP"],
                           max_tokens=len(forced), extra_body={"agentrt_forced_token_ids": forced})
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    assert message.content[0].text == "Alpha"  # as strip_tool_calls leaves it
    message, _, _ = _ask(alice, model, [{"role": "user", "content": "Long."}], max_tokens=2,
                         extra_body={"agentrt_forced_token_ids": tokens("one two three")[:2]})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2
    forced = tokens(" forty-two" + END)
    message, cid, _ = _ask(alice, model, [{"role": "user", "content": "The answer?"},
                                          {"role": "assistant", "content": "The answer is"}],
                           max_tokens=len(forced), extra_body={"agentrt_forced_token_ids": forced})
    assert message.content[0].text == " forty-two" and message.stop_reason == "end_turn"
    turn = _chain(http, keys["alice"], cid)["turns"][0]
    assert turn["assistant_prefix"] == "The answer is" and turn["message"]["content"] == "The answer is forty-two"


def test_errors_are_anthropics_and_name_the_field(alice, http, keys, model):
    ask = [{"role": "user", "content": "hi"}]
    total = http.get("/v1/chains", headers=bearer(keys["alice"])).json()["total"]
    cases = [
        (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), "messages[0].content[0].type"),
        (dict(messages=ask, extra_body={"bogus": 1}), "bogus"),
        (dict(messages=ask, tool_choice={"type": "any"}), "tool_choice"),  # no tools to call
        (dict(messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
        (dict(messages=ask, tools=[WEATHER, {"name": "odd", "input_schema": {
            "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}],
              tool_choice={"type": "any"}), "tools[1].input_schema"),
        (dict(messages=ask, extra_body={"container": "c"}), "container"),
        (dict(messages=ask, extra_body={"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
         "mcp_servers"),
        (dict(messages=ask, extra_body={"temperature": 1.5}), "temperature"),
        (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none",
                                                      "content": "x"}]}]), "messages[0].content[0].tool_use_id"),
        (dict(messages=[{"role": "assistant", "content": "first"}, *ask]), "messages[0].role"),
        (dict(messages=ask, extra_body={"context_management": {"edits": [
            {"type": "clear_tool_uses_20250919", "clear_tool_inputs": "yes"}]}}),
         "context_management.edits[0].clear_tool_inputs"),  # more bad values: test_anthropic_clear_tool_inputs
        (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"}]}]), "messages[1].content[0].type"),
    ]
    for kwargs, field in cases:
        kwargs.setdefault("max_tokens", 2)
        with pytest.raises(anthropic.BadRequestError) as err:
            alice.messages.create(model=model, **kwargs)
        body = err.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(field), (field, body)
    # a prompt the engine refuses: a 400 on messages, and the chain made for it is gone again
    with pytest.raises(anthropic.BadRequestError) as err:
        alice.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "hello " * 5000}])
    assert err.value.body["error"]["message"].startswith("messages: prompt has")
    assert http.get("/v1/chains", headers=bearer(keys["alice"])).json()["total"] == total
    with pytest.raises(anthropic.NotFoundError) as err:
        alice.messages.create(model="claude-nope", max_tokens=2, messages=ask)
    assert err.value.body["error"]["type"] == "not_found_error" and "claude-nope" in err.value.body["error"]["message"]
    # accepted, no effect
    message = alice.messages.create(model=model, max_tokens=2, messages=ask, service_tier="auto",
                                    thinking={"type": "disabled"}, metadata={"user_id": "u"},
                                    tool_choice={"type": "none"}, tools=[WEATHER],
                                    system=[{"type": "text", "text": "Be brief.",
                                             "cache_control": {"type": "ephemeral"}}],
                                    extra_body=GREEDY)
    assert message.type == "message"


def test_tool_choice_any_and_tool_force_calls_that_follow_the_input_schema(alice, model):
    ask = [{"role": "user", "content": "Look something up."}]
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, SEARCH)}
    # the embedded model never calls a tool by itself: auto gives text only
    message, _, _ = _ask(alice, model, ask, tools=[WEATHER, SEARCH], max_tokens=40)
    assert not [b for b in message.content if b.type == "tool_use"]
    for choice, names in (({"type": "any"}, ("get_weather", "search")),
                          ({"type": "any", "disable_parallel_tool_use": True}, ("get_weather", "search")),
                          ({"type": "tool", "name": "search"}, ("search",))):
        message, _, _ = _ask(alice, model, ask, tools=[WEATHER, SEARCH], tool_choice=choice, max_tokens=300)
        assert message.stop_reason == "tool_use", (choice, message)
        calls = [b for b in message.content if b.type == "tool_use"]
        assert calls and all(b.type == "tool_use" for b in message.content), (choice, message)
        if choice.get("disable_parallel_tool_use") or choice["type"] == "tool":
            assert len(calls) == 1, (choice, message)
        for call in calls:
            assert call.name in names and call.id.startswith("toolu_")
            validate(call.input, schemas[call.name])
    streamed, _, _ = _stream(alice, model, ask, tools=[WEATHER, SEARCH], tool_choice={"type": "tool", "name": "search"},
                             max_tokens=300)
    assert _comparable(streamed) == _comparable(message)


def test_clear_tool_uses_prunes_the_chain_and_the_next_request_still_resumes(alice, http, keys, model, tokens):
    forced = tokens(TOOL_CALL + END)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1}}
    history: list = [{"role": "user", "content": "Track the weather."}]
    results, cid = [], None
    for i in range(3):
        raw = alice.beta.messages.with_raw_response.create(
            model=model, max_tokens=len(forced), messages=history, tools=[WEATHER],
            betas=["context-management-2025-06-27"], context_management={"edits": [edit]},
            extra_body={**GREEDY, "agentrt_forced_token_ids": forced})
        message = raw.parse()
        cid = cid or raw.headers["agentrt-chain-id"]
        assert raw.headers["agentrt-chain-id"] == cid
        results.append(message)
        (call,) = [b for b in message.content if b.type == "tool_use"]
        history += [_returned(message), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": f'{{"reading": {i}, "detail": "{"x" * 40}"}}'}]}]
    # the third request carried the second tool result: two uses, not over the trigger yet
    assert [m.context_management.applied_edits for m in results] == [[], [], []]
    raw = alice.beta.messages.with_raw_response.create(
        model=model, max_tokens=4, messages=history, tools=[WEATHER], betas=["context-management-2025-06-27"],
        context_management={"edits": [edit]}, extra_body=GREEDY)
    message = raw.parse()
    assert raw.headers["agentrt-chain-id"] == cid and raw.headers["agentrt-chain-resolution"] == "resumed"
    chain = _chain(http, keys["alice"], cid)
    tool_regions = [r for r in chain["regions"] if r["kind"] == "tool_result"]
    assert [r["pruned"] for r in tool_regions] == [True, True, False]  # the newest use kept
    (applied,) = message.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 2
    assert applied.cleared_input_tokens == sum(r["end"] - r["start"] for r in tool_regions[:2])
    event = chain["prune_events"][-1]
    assert event["regions"] == [r["index"] for r in tool_regions[:2]] and event["tokens_freed"] > 0
    assert chain["turns"][-1]["resume_status"] == "resumed"
    # the next request re-sends the cleared results as they were: the chain still matches and resumes
    history += [_returned(message), {"role": "user", "content": "Summary?"}]
    raw = alice.beta.messages.with_raw_response.create(
        model=model, max_tokens=4, messages=history, tools=[WEATHER], betas=["context-management-2025-06-27"],
        context_management={"edits": [edit]}, extra_body=GREEDY)
    after = raw.parse()
    assert (raw.headers["agentrt-chain-id"], raw.headers["agentrt-chain-resolution"]) == (cid, "resumed")
    turn = _chain(http, keys["alice"], cid)["turns"][-1]
    assert turn["resume_status"] == "resumed" and after.usage.cache_read_input_tokens > 0
    assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
    assert after.context_management.applied_edits[0].cleared_tool_uses == 2


def test_count_tokens_is_the_prompt_the_engine_sees(alice, http, keys, model):
    history: list = [{"role": "user", "content": "Count me."}]
    system = "Count carefully."
    counted = alice.messages.count_tokens(model=model, messages=history, system=system, tools=[WEATHER])
    message, cid, _ = _ask(alice, model, history, system=system, tools=[WEATHER])
    assert counted.input_tokens == _chain(http, keys["alice"], cid)["turns"][0]["usage"]["prompt_tokens"]
    history += [_returned(message), {"role": "user", "content": "And again."}]
    counted = alice.messages.count_tokens(model=model, messages=history, system=system, tools=[WEATHER])
    _, cid2, how = _ask(alice, model, history, system=system, tools=[WEATHER])
    assert (cid2, how) == (cid, "resumed")
    assert counted.input_tokens == _chain(http, keys["alice"], cid)["turns"][1]["usage"]["prompt_tokens"]


def test_a_restarted_server_finds_the_conversations_chain(alice, db_url, keys, model):
    history: list = [{"role": "user", "content": "Survive a restart."}]
    message, cid, _ = _ask(alice, model, history, metadata={"user_id": "restart"})
    history += [_returned(message), {"role": "user", "content": "Still there?"}]
    with app_server(db_url, require_auth=True) as restarted:  # a new process's index: rebuilt from the chains' metadata
        client = anthropic.Anthropic(base_url=restarted.url, api_key=keys["alice"], max_retries=0)
        _, again, how = _ask(client, model, history, metadata={"user_id": "restart"})
        assert (again, how) == (cid, "resumed")
        with httpx.Client(base_url=restarted.url, timeout=60) as http:
            turn = _chain(http, keys["alice"], cid)["turns"][-1]
        assert turn["resume_status"] == "recomputed"  # the new engine holds no KV for it yet


def test_the_routers_own_errors_keep_each_apis_shape(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error" and r.json()["error"]["type"], r.text
        r = http.get("/v1/responses")
        assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        r = http.get("/v1/chains/x/fork")
        assert r.status_code == 405 and r.json()["status_code"] == 405, r.text


def test_opening_system_messages_join_the_system_prompt():
    """Anthropic's ``role: "system"`` messages: those that open the conversation follow ``system`` in the system
    prompt, in order (the reference: the conversation as the chat template renders it)."""
    from agentrt.anthropic_input import conversation
    import msgspec

    from agentrt.anthropic_types import MessagesRequest

    req = msgspec.convert({"model": "m", "max_tokens": 2, "system": "S", "messages": [
        {"role": "system", "content": "A"}, {"role": "system", "content": [{"type": "text", "text": "B"}]},
        {"role": "user", "content": "hi"}]}, MessagesRequest)
    conv = conversation(req)
    assert conv.system == "S\nA\nB" and conv.messages == [{"role": "user", "content": "hi"}]
    no_top = msgspec.convert({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": "A"}, {"role": "user", "content": "hi"}]}, MessagesRequest)
    assert conversation(no_top).system == "A"


def test_output_config_format_makes_the_reply_follow_the_schema(alice, model):
    """Anthropic's structured outputs (``output_config.format``) on the embedded model at temperature 1: every
    reply's text parses and validates against the schema (the reference: the schema itself, checked here)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "temp_c": {"type": "integer", "minimum": -40, "maximum": 50}},
              "required": ["city", "temp_c"], "additionalProperties": False}
    for seed in range(6):
        message = alice.messages.create(model=model, max_tokens=60,  # temperature 1, the default
                                        messages=[{"role": "user", "content": f"Weather report {seed} as JSON."}],
                                        output_config={"format": {"type": "json_schema", "schema": schema}})
        assert message.stop_reason == "end_turn", message
        value = json.loads(message.content[0].text)
        assert set(value) == {"city", "temp_c"} and len(value["city"]) <= 12 and -40 <= value["temp_c"] <= 50
