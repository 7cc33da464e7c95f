"""The server against the real app (Litestar's TestClient) on the random tiny model, SQLite in tmp_path."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import (ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL, generate_direct, make_engine, post_turn,
                                  sse_events, weather_tool_round)

SAMPLING = {"temperature": 0.0, "max_tokens": 12}
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def model_dir():
    return random_model_dir()


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'server.db'}"


@pytest.fixture(scope="module")
def client(model_dir, db_url):
    app = create_app(ServerConfig(model=model_dir, db_url=db_url, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from engine.llm_engine import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def session(client):
    """A 3-turn agent session: user (answered with a tool call), tool result, user."""
    chain = client.post("/v1/chains", json={"system_prompt": "You are a weather agent.", "tools": [WEATHER_TOOL],
                                            "metadata": {"test": "session"}})
    assert chain.status_code == 201, chain.text
    cid = chain.json()["id"]
    first, second = weather_tool_round(client, cid, SAMPLING)
    third = post_turn(client, cid, {"sampling": SAMPLING, "messages": [{"role": "user", "content": "Umbrella?"}]})
    return cid, [first, second, third]


def _chain(client, cid, tokens=True):
    r = client.get(f"/v1/chains/{cid}", params={"include_tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()


def test_turn_results_tool_call_and_token_log(client, session):
    cid, results = session
    assert [r["turn"] for r in results] == [0, 1, 2]
    call = results[0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert results[0]["message"]["content"].startswith(TOOL_CALL)
    assert results[0]["resume_status"] == "created"
    assert {r["resume_status"] for r in results[1:]} <= {"resumed", "recomputed"}

    chain = _chain(client, cid)
    turns = chain["turns"]
    assert chain["num_turns"] == 3 and chain["status"] == "idle"
    assert chain["token_ids"] == [t for turn in turns for t in turn["appended_token_ids"] + turn["generated_token_ids"]]
    assert chain["num_tokens"] == len(chain["token_ids"]) == chain["kv"]["logical_tokens"]
    pos = 0
    for turn, result in zip(turns, results):
        usage = result["usage"]
        assert turn["usage"] == usage and turn["message"] == result["message"]
        assert usage["appended_tokens"] == len(turn["appended_token_ids"])
        assert usage["prompt_tokens"] == pos + usage["appended_tokens"]
        assert usage["completion_tokens"] == len(turn["generated_token_ids"]) == SAMPLING["max_tokens"] or \
            turn["finish_reason"] == "stop"
        assert usage["prefilled_tokens"] + usage["resumed_tokens"] >= usage["appended_tokens"]
        assert 1 <= usage["prefilled_tokens"] <= usage["prompt_tokens"]
        pos = usage["prompt_tokens"] + usage["completion_tokens"]
    assert turns[1]["messages"][0]["name"] == "get_weather"  # filled in from the call with that id


def test_regions_cover_the_log_and_decode_to_the_rendered_messages(client, session, tokenizer):
    cid, results = session
    chain = _chain(client, cid)
    log, regions, turns = chain["token_ids"], chain["regions"], chain["turns"]
    assert [r["kind"] for r in regions] == ["system", "user", "assistant", "tool_result", "assistant", "user",
                                            "assistant"]
    assert [r["turn"] for r in regions] == [0, 0, 0, 1, 1, 2, 2]
    assert regions[0]["start"] == 0 and regions[-1]["end"] == len(log)
    assert all(a["end"] == b["start"] for a, b in zip(regions, regions[1:]))
    assert all(r["kept_tokens"] == r["end"] - r["start"] and not r["pruned"] for r in regions)
    tool = regions[3]
    assert (tool["tool_name"], tool["round"], tool["tool_call_id"]) == (
        "get_weather", 0, results[0]["message"]["tool_calls"][0]["id"])

    def text(r):
        return tokenizer.decode(log[r["start"]:r["end"]], skip_special_tokens=False)

    system = tokenizer.apply_chat_template([{"role": "system", "content": "You are a weather agent."}],
                                           tools=[WEATHER_TOOL], tokenize=False)
    assert text(regions[0]) == system
    assert text(regions[1]) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    assert text(regions[3]) == '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>\n'
    assert text(regions[5]) == "<|im_start|>user\nUmbrella?<|im_end|>\n"
    prefix_ids = tokenizer.encode("<|im_start|>assistant\n" + TOOL_CALL, add_special_tokens=False)
    plain_ids = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for region, turn, opening in zip(regions[2::2], turns, [prefix_ids, plain_ids, plain_ids]):
        span = log[region["start"]:region["end"]]
        generated = turn["generated_token_ids"]
        assert span[:len(opening) + len(generated)] == opening + generated  # exactly as generated
        closing = tokenizer.decode(span[len(opening) + len(generated):], skip_special_tokens=False)
        if region is regions[-1]:
            assert closing == ""
        else:
            assert closing == ("\n" if tokenizer.decode(generated[-1:]) == IM_END else IM_END + "\n")


def test_greedy_turns_equal_the_engine_run_directly_on_the_same_history(client, session, model_dir):
    cid, _ = session
    chain = _chain(client, cid)
    engine = make_engine(model_dir)
    for turn in chain["turns"]:
        prompt = chain["token_ids"][:turn["usage"]["prompt_tokens"]]
        assert generate_direct(engine, prompt, SAMPLING["max_tokens"]) == turn["generated_token_ids"]


def test_sse_deltas_concatenate_to_the_final_text(client):
    cid = client.post("/v1/chains", json={}).json()["id"]
    body = {"messages": [{"role": "user", "content": "Stream please"}], "sampling": {"max_tokens": 16},
            "stream": True}
    with client.stream("POST", f"/v1/chains/{cid}/turns", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    deltas = [data for name, data in events if name == "delta"]
    (name, final), = [e for e in events if e[0] != "delta"]
    assert name == "done" and len(deltas) >= 1
    assert "".join(d["text"] for d in deltas) == final["message"]["content"]
    turn = _chain(client, cid)["turns"][0]
    assert [t for d in deltas for t in d["token_ids"]] == turn["generated_token_ids"]
    assert final["usage"]["completion_tokens"] == 16


def _error(r, status, key=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status_code"] == status
    if key is not None:
        assert key in body["detail"], body
        assert key in [d.get("key") for d in body.get("extra") or []], body
    return body


def test_bad_input_is_4xx_naming_the_field_and_changes_nothing(client):
    cid = client.post("/v1/chains", json={}).json()["id"]
    turns = f"/v1/chains/{cid}/turns"
    user = [{"role": "user", "content": "hi"}]
    _error(client.get("/v1/chains/chain_nope"), 404)
    _error(client.delete("/v1/chains/chain_nope"), 404)
    _error(client.post("/v1/chains/chain_nope/turns", json={"messages": user}), 404)
    _error(client.post("/v1/chains", json={"sytem_prompt": "typo"}), 400, "sytem_prompt")
    _error(client.post("/v1/chains", json={"model": "gpt-9"}), 400, "model")
    _error(client.post("/v1/chains", json={"method": "no-such-method"}), 400, "method")
    _error(client.post("/v1/chains", json={"tools": [{"type": "function", "function": {}}]}), 400, "tools[0].function.name")
    _error(client.post(turns, json={"messages": user, "sampling": {"max_tokens": 0}}), 400, "sampling.max_tokens")
    _error(client.post(turns, json={"messages": user, "sampling": {"max_tokens": 10**6}}), 400, "sampling.max_tokens")
    _error(client.post(turns, json={"messages": user, "sampling": {"temperatur": 1}}), 400, "sampling.temperatur")
    _error(client.post(turns, json={"messages": user, "sampling": {"top_p": "high"}}), 400, "sampling.top_p")
    _error(client.post(turns, json={"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role")
    _error(client.post(turns, json={"messages": [{"role": "tool", "content": "x"}]}), 400, "messages[0].tool_call_id")
    _error(client.post(turns, json={"messages": []}), 400, "messages")
    _error(client.post(turns, json={"messages": user, "stream": "yes"}), 400, "stream")
    _error(client.post(turns, content=b'{"messages": [{"role": "user", "content": "hi"}], "sampling": {"temperature": 1e999}}',
                       headers={"content-type": "application/json"}), 400)
    _error(client.post(turns, json={"messages": user, "sampling": {"temperature": -1}}), 400, "sampling.temperature")
    _error(client.post(turns, content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    _error(client.post(turns, content=b"", headers={"content-type": "application/json"}), 400)
    _error(client.post(turns, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    _error(client.get("/v1/chains", params={"limit": 0}), 400, "limit")
    _error(client.get("/v1/chains", params={"offset": "x"}), 400, "offset")
    too_long = _error(client.post(turns, json={"messages": [{"role": "user", "content": "word " * 6000}]}), 422)
    assert "max_model_len" in too_long["detail"]
    chain = _chain(client, cid)
    assert (chain["num_turns"], chain["num_tokens"], chain["regions"], chain["status"]) == (0, 0, [], "idle")
    assert client.post(turns, json={"messages": user, "sampling": SAMPLING}).status_code == 200


def test_list_is_paged(client):
    ids = [client.post("/v1/chains", json={"metadata": {"page": i}}).json()["id"] for i in range(3)]
    listed = []
    offset = 0
    while True:
        page = client.get("/v1/chains", params={"offset": offset, "limit": 2}).json()
        assert page["limit"] == 2 and len(page["data"]) <= 2
        listed += [c["id"] for c in page["data"]]
        if not page["has_more"]:
            break
        offset += 2
    assert len(listed) == page["total"] == len(set(listed)) and set(ids) <= set(listed)


def test_delete_frees_the_chain(client):
    def pages_used():
        line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("agentrt_kv_pages_used"))
        return float(line.split()[-1])

    cid = client.post("/v1/chains", json={"system_prompt": "a prompt no other chain shares"}).json()["id"]
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "x " * 200}],
                                                     "sampling": SAMPLING})
    assert r.status_code == 200
    before = pages_used()
    kv = _chain(client, cid)["kv"]
    assert client.delete(f"/v1/chains/{cid}").status_code == 204
    assert pages_used() == before - kv["pages"]
    _error(client.get(f"/v1/chains/{cid}"), 404)
    _error(client.delete(f"/v1/chains/{cid}"), 404)
    assert cid not in [c["id"] for c in client.get("/v1/chains", params={"limit": 100}).json()["data"]]


def test_health_and_metrics(client, session):
    assert client.get("/health").json()["status"] == "ok"
    text = client.get("/metrics").text
    for name in ("agentrt_kv_pages_used", "agentrt_kv_pages_free", 'agentrt_chains{state="idle"}',
                 "agentrt_engine_step_seconds_bucket", "agentrt_tokens_prefilled_total", 'agentrt_turns_total{outcome="ok"}'):
        assert name in text, name
    prefilled = next(x for x in text.splitlines() if x.startswith("agentrt_tokens_prefilled_total"))
    assert float(prefilled.split()[-1]) > 0


def test_a_new_app_on_the_same_database_sees_everything_and_continues(client, session, db_url, model_dir):
    cid, _ = session
    other = client.post("/v1/chains", json={"metadata": {"test": "restart"}}).json()["id"]
    for text in ("one", "two"):
        r = client.post(f"/v1/chains/{other}/turns", json={"messages": [{"role": "user", "content": text}],
                                                            "sampling": SAMPLING})
        assert r.status_code == 200, r.text
    before = {c: _chain(client, c) for c in (cid, other)}
    app = create_app(ServerConfig(model=model_dir, db_url=db_url, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as fresh:
        listed = [c["id"] for c in fresh.get("/v1/chains", params={"limit": 100}).json()["data"]]
        for c, old in before.items():
            new = _chain(fresh, c)
            assert c in listed
            for key in ("turns", "regions", "token_ids", "num_turns", "num_tokens", "system_prompt", "tools",
                        "metadata"):
                assert new[key] == old[key], key
        r = fresh.post(f"/v1/chains/{other}/turns", json={"messages": [{"role": "user", "content": "three"}],
                                                           "sampling": SAMPLING})
        assert r.status_code == 200, r.text
        third = r.json()
        assert third["turn"] == 2 and third["resume_status"] == "recomputed"
        chain = _chain(fresh, other)
        old_log = before[other]["token_ids"]
        assert chain["token_ids"][:len(old_log)] == old_log
        assert third["usage"]["prompt_tokens"] == len(old_log) + third["usage"]["appended_tokens"]
        assert [r["kind"] for r in chain["regions"]] == ["system", "user", "assistant"] + ["user", "assistant"] * 2
        assert all(a["end"] == b["start"] for a, b in zip(chain["regions"], chain["regions"][1:]))
