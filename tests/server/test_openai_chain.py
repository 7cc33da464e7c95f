"""The ``chain_id`` extension of /v1/chat/completions, driven by the official ``openai`` package against a real
uvicorn: the request resumes the chain's KV (only the new suffix is prefilled), the turn is appended to the
chain, and a history that differs from the chain's is a 409 that changes nothing.

References: the chain's token log and KV counters read back over the chain API (exact counts), the model's
chat template rendered by the HF tokenizer, and greedy generation on a bare engine over the same tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.tool_syntax import ToolCallReader, by_name
from engine.tiny_checkpoint import random_model_dir
from tests.live_servers import client, model, server  # noqa: F401 (fixtures)
from tests.server_helpers import (ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL, bearer, generate_direct, make_engine,
                                  make_keys)

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

SYSTEM = "Be brief."
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _chain(http) -> str:
    r = http.post("/v1/chains", json={"tools": [WEATHER_TOOL], "system_prompt": SYSTEM})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _read(http, cid) -> dict:
    return http.get(f"/v1/chains/{cid}?include_tokens=true").json()


def _returned(choice) -> dict:
    """The assistant message as a client appends it to its history."""
    return choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def test_chain_id_resumes_the_chain_and_appends_the_turn(http, client, model):
    cid = _chain(http)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir())
    ask = {"role": "user", "content": "Weather in Paris?"}
    first = client.chat.completions.create(model=model, messages=[ask], temperature=0, max_tokens=MAX_TOKENS,
                                           tools=[WEATHER_TOOL], extra_body={"chain_id": cid})
    assert first.model_extra["chain"] == {"id": cid, "turn": 0, "resume_status": "created"}
    chain = _read(http, cid)
    template = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, ask], tools=[WEATHER_TOOL],
                                             tokenize=False, add_generation_prompt=True)
    assert chain["turns"][0]["appended_token_ids"] == tokenizer.encode(template, add_special_tokens=False)
    assert first.usage.prompt_tokens == len(chain["turns"][0]["appended_token_ids"])
    assert first.usage.completion_tokens == len(chain["turns"][0]["generated_token_ids"])
    # the route returns the turn's text as strip_tool_calls gives it (None when nothing is left)
    assert (HERMES.reply_content(chain["turns"][0]["message"]["content"]) or None) == first.choices[0].message.content

    history = [{"role": "system", "content": SYSTEM}, ask, _returned(first.choices[0])]
    engine = make_engine(random_model_dir())  # the reference: a bare engine over the chain's whole token log
    for turn, stream in ((1, False), (2, True)):
        before = _read(http, cid)
        history.append({"role": "user", "content": f"And city number {turn}?"})
        kwargs = dict(model=model, messages=history, temperature=0, max_tokens=MAX_TOKENS,
                      extra_body={"chain_id": cid})
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finished = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
            info, used = finished.model_extra["chain"], chunks[-1].usage
            history.append({"role": "assistant", "content": text})
        else:
            done = client.chat.completions.create(**kwargs)
            text, info, used = done.choices[0].message.content, done.model_extra["chain"], done.usage
            history.append(_returned(done.choices[0]))
        after = _read(http, cid)
        new = after["turns"][turn]
        assert info == {"id": cid, "turn": turn, "resume_status": "resumed"}
        assert after["num_turns"] == turn + 1 and new["messages"] == [history[-2]]
        assert HERMES.reply_content(new["message"]["content"]) == (text or "")
        assert after["token_ids"][: before["num_tokens"]] == before["token_ids"]  # appended, never rewritten
        prompt = before["token_ids"] + new["appended_token_ids"]
        assert used.prompt_tokens == len(prompt) and used.completion_tokens == len(new["generated_token_ids"])
        assert used.prompt_tokens_details.cached_tokens == before["kv"]["computed_tokens"] > 0
        assert new["usage"]["prefilled_tokens"] == len(prompt) - before["kv"]["computed_tokens"]
        assert new["usage"]["prefilled_tokens"] <= len(new["appended_token_ids"]) + 1  # the new suffix only
        assert generate_direct(engine, prompt, MAX_TOKENS) == new["generated_token_ids"]


def test_tool_calls_round_trip_through_the_chain(http, client, model):
    cid = _chain(http)
    forced = AutoTokenizer.from_pretrained(random_model_dir()).encode(TOOL_CALL, add_special_tokens=False)
    history: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=len(forced),
                                           extra_body={"chain_id": cid, "forced_token_ids": forced})
    (call,) = first.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    history += [_returned(first.choices[0]), {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    second = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"chain_id": cid})
    assert second.model_extra["chain"]["resume_status"] == "resumed"
    regions = _read(http, cid)["regions"]
    (tool,) = [r for r in regions if r["kind"] == "tool_result"]
    assert (tool["tool_name"], tool["tool_call_id"], tool["turn"], tool["round"]) == ("get_weather", call.id, 1, 0)

    as_generated = [history[0], {"role": "assistant", "content": _read(http, cid)["turns"][0]["message"]["content"]},
                    history[2], _returned(second.choices[0]), {"role": "user", "content": "Thanks"}]
    third = client.chat.completions.create(model=model, messages=as_generated, temperature=0, max_tokens=2,
                                           extra_body={"chain_id": cid})
    assert third.model_extra["chain"]["turn"] == 2  # the raw text, markup and all, matches as well


def test_a_diverging_history_is_409_and_changes_nothing(http, client, model):
    cid = _chain(http)
    ask = {"role": "user", "content": "Hello"}
    first = client.chat.completions.create(model=model, messages=[ask], max_tokens=3, temperature=0,
                                           extra_body={"chain_id": cid})
    reply = _returned(first.choices[0])
    before = _read(http, cid)
    more = {"role": "user", "content": "More"}
    diverging = [
        (0, [{"role": "user", "content": "Hi"}, reply, more]),
        (1, [ask, {"role": "assistant", "content": (reply.get("content") or "") + "!"}, more]),
        (0, [{"role": "system", "content": "Be verbose."}, ask, reply, more]),
        (2, [{"role": "system", "content": SYSTEM}, ask, more]),  # a user message where the chain has its reply
        (1, [ask]),  # shorter than the chain's history
    ]
    for index, messages in diverging:
        with pytest.raises(openai.ConflictError) as err:
            client.chat.completions.create(model=model, messages=messages, max_tokens=3, extra_body={"chain_id": cid})
        assert err.value.param == f"messages[{index}]"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[ask, reply], extra_body={"chain_id": cid})
    assert err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[ask, reply, more], tools=[], extra_body={"chain_id": cid})
    assert err.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[ask, reply, {"role": "system", "content": "x"}],
                                       extra_body={"chain_id": cid})
    assert err.value.param == "messages[2]"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=[ask], extra_body={"chain_id": "chain_nope"})
    after = _read(http, cid)
    assert {k: after[k] for k in ("num_turns", "token_ids", "turns", "regions", "status")} == \
        {k: before[k] for k in ("num_turns", "token_ids", "turns", "regions", "status")}
    ok = client.chat.completions.create(model=model, messages=[ask, reply, more], max_tokens=3,
                                        extra_body={"chain_id": cid})
    assert ok.model_extra["chain"]["turn"] == 1


def test_another_tenants_chain_is_404(tmp_path):
    from litestar.testing import TestClient

    db_url = f"sqlite+aiosqlite:///{tmp_path / 'tenants.db'}"
    keys = make_keys(db_url, "alice", "bob")
    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS, require_auth=True)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        r = c.post("/v1/chains", json={}, headers=bearer(keys["alice"]))
        cid = r.json()["id"]
        body = {"model": c.get("/v1/models", headers=bearer(keys["alice"])).json()["data"][0]["id"], "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}], "chain_id": cid}
        theirs = c.post("/v1/chat/completions", json=body, headers=bearer(keys["bob"]))
        assert theirs.status_code == 404 and cid in theirs.json()["error"]["message"]
        assert theirs.json()["error"]["param"] == "chain_id"
        assert c.get(f"/v1/chains/{cid}", headers=bearer(keys["alice"])).json()["num_turns"] == 0
        mine = c.post("/v1/chat/completions", json=body, headers=bearer(keys["alice"]))
        assert mine.status_code == 200 and mine.json()["chain"] == {"id": cid, "turn": 0, "resume_status": "created"}
