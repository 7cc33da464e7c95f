"""Prune / fork / rewind, pruning policies and the WebSocket route, against the real app (Litestar's TestClient)
on the random tiny model, SQLite in tmp_path."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL, generate_direct, make_engine

SAMPLING = {"temperature": 0.0, "max_tokens": 6}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Web search"}}


@pytest.fixture(scope="module")
def model_dir():
    return random_model_dir()


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'prune.db'}"


@pytest.fixture(scope="module")
def client(model_dir, db_url):
    app = create_app(ServerConfig(model=model_dir, db_url=db_url, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as c:
        yield c


def _create(client, **body) -> str:
    r = client.post("/v1/chains", json={"tools": [WEATHER_TOOL, SEARCH_TOOL], **body})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _turn(client, cid, messages, **body) -> dict:
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": messages, "sampling": SAMPLING, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _chain(client, cid, tokens=False) -> dict:
    r = client.get(f"/v1/chains/{cid}", params={"include_tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()


def _tool(call_id: str, i: int, name: str | None = None) -> dict:
    message = {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"round": i, "rows": ["x" * 40] * 6})}
    return message if name is None else {**message, "name": name}


def _error(r, status, key=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    if key is not None:
        assert key in [d.get("key") for d in body.get("extra") or []], body
    return body


def _resumed_only_new(result):
    usage = result["usage"]
    assert result["resume_status"] == "resumed", result
    assert usage["prefilled_tokens"] == usage["appended_tokens"] + 1, usage
    assert usage["resumed_tokens"] == usage["prompt_tokens"] - usage["prefilled_tokens"]


def test_ten_turn_agent_session_with_a_lag_2_policy(client):
    cid = _create(client, prune_policy={"lag": 2})
    assert _chain(client, cid)["prune_policy"]["lag"] == 2
    result = _turn(client, cid, [{"role": "user", "content": "Weather in Paris?"}], assistant_prefix=TOOL_CALL)
    assert result["pruned"] == [] and result["resume_status"] == "created"
    freed_total, seen_events = 0, []
    for t in range(1, 10):
        call_id = result["message"]["tool_calls"][0]["id"]
        result = _turn(client, cid, [_tool(call_id, t)], assistant_prefix=TOOL_CALL)
        _resumed_only_new(result)
        chain = _chain(client, cid)
        tools = [r for r in chain["regions"] if r["kind"] == "tool_result"]
        assert [r["round"] for r in tools] == list(range(t))
        newest = t - 1
        # lag 2: once round k arrives, every round <= k - 2 is pruned; the 2 most recent stay whole
        assert [r["pruned"] for r in tools] == [r["round"] <= newest - 2 for r in tools]
        for r in tools:
            assert r["kept_tokens"] == (0 if r["pruned"] else r["end"] - r["start"])
        if newest >= 2:
            (event,) = result["pruned"]
            (due,) = [r for r in tools if r["round"] == newest - 2]
            assert event["source"] == "policy" and event["regions"] == [due["index"]]
            assert event["intervals"] == [[due["start"], due["end"]]]
            assert event["tokens_freed"] == due["end"] - due["start"]  # keep_ratio 0: all of it
            assert event["pages_freed"] > 0
            assert event["pages_before"] - event["pages_after"] == event["pages_freed"]
            assert chain["kv"]["pages"] == event["pages_after"]
            freed_total += event["tokens_freed"]
            seen_events.append(event)
        else:
            assert result["pruned"] == []
        kv = chain["kv"]
        assert kv["compacted"] == (freed_total > 0) and kv["engine_status"] == "idle"
        assert kv["physical_tokens_per_layer"] == [kv["computed_tokens"] - freed_total] * len(
            kv["physical_tokens_per_layer"])
        assert kv["computed_tokens"] == kv["logical_tokens"] - 1
    chain = _chain(client, cid)
    assert chain["prune_events"] == seen_events and len(seen_events) == 7
    assert chain["pruned_intervals"] == [e["intervals"][0] for e in seen_events]
    assert "agentrt_tokens_pruned_total" in client.get("/metrics").text


def test_policy_threshold_and_excluded_tools(client):
    cid = _create(client, prune_policy={"lag": 0, "min_tool_tokens": 10**6})
    first = _turn(client, cid, [{"role": "user", "content": "go"}], assistant_prefix=TOOL_CALL)
    second = _turn(client, cid, [_tool(first["message"]["tool_calls"][0]["id"], 0)])
    assert second["pruned"] == []  # below the trigger threshold
    assert not any(r["pruned"] for r in _chain(client, cid)["regions"])

    cid = _create(client, prune_policy={"lag": 0, "exclude_tools": ["get_weather"]})
    _turn(client, cid, [{"role": "user", "content": "go"}])
    result = _turn(client, cid, [_tool("call_a", 0, "get_weather"), _tool("call_b", 0, "search")])
    (event,) = result["pruned"]
    regions = {r["tool_name"]: r for r in _chain(client, cid)["regions"] if r["kind"] == "tool_result"}
    assert event["regions"] == [regions["search"]["index"]]
    assert regions["search"]["pruned"] and not regions["get_weather"]["pruned"]


def test_keep_tokens_policy_keeps_that_many_of_each_due_region(client):
    cid = _create(client, prune_policy={"lag": 0, "keep_tokens": 8, "scorer": "knorm"})
    _turn(client, cid, [{"role": "user", "content": "go"}])
    before = _chain(client, cid)
    result = _turn(client, cid, [_tool("call_a", 0, "get_weather"), _tool("call_b", 0, "search")])
    (event,) = result["pruned"]
    chain = _chain(client, cid)
    tools = [r for r in chain["regions"] if r["kind"] == "tool_result"]
    assert len(tools) == 2 and tools[0]["end"] == tools[1]["start"]  # adjacent: still pruned one by one
    assert event["keep_tokens"] == 8 and event["intervals"] == [[r["start"], r["end"]] for r in tools]
    assert event["tokens_freed"] == sum(r["end"] - r["start"] - 8 for r in tools)
    assert [(r["pruned"], r["kept_tokens"]) for r in tools] == [(True, 8), (True, 8)]
    assert event["pages_before"] - event["pages_after"] == event["pages_freed"] > 0
    kv = chain["kv"]
    assert kv["physical_tokens_per_layer"] == [kv["computed_tokens"] - event["tokens_freed"]] * len(
        kv["physical_tokens_per_layer"])
    assert before["kv"]["computed_tokens"] < kv["computed_tokens"]
    _resumed_only_new(_turn(client, cid, [{"role": "user", "content": "Next?"}]))

    # explicit: keep 5 of each selected region, by a selector
    r = client.post(f"/v1/chains/{cid}/prune", json={"kinds": ["user"], "scorer": "knorm", "keep_tokens": 5})
    assert r.status_code == 200, r.text
    pruned = r.json()
    users = [x for x in _chain(client, cid)["regions"] if x["kind"] == "user"]
    assert pruned["tokens_freed"] == sum(max(0, x["end"] - x["start"] - 5) for x in users)
    assert all(x["kept_tokens"] == min(5, x["end"] - x["start"]) for x in users)


def test_explicit_prune_by_interval_and_by_selector_then_the_next_turn_resumes(client):
    cid = _create(client)
    first = _turn(client, cid, [{"role": "user", "content": "Look this up. " * 30}], assistant_prefix=TOOL_CALL)
    _turn(client, cid, [_tool(first["message"]["tool_calls"][0]["id"], 0)])
    before = _chain(client, cid)
    user = before["regions"][1]
    assert user["kind"] == "user"
    r = client.post(f"/v1/chains/{cid}/prune", json={"intervals": [[user["start"], user["end"]]]})
    assert r.status_code == 200, r.text
    pruned = r.json()
    after = _chain(client, cid)
    assert pruned["tokens_freed"] == user["end"] - user["start"] and pruned["pages_freed"] > 0
    assert before["kv"]["pages"] - after["kv"]["pages"] == pruned["pages_freed"]
    assert pruned["event"]["pages_before"] == before["kv"]["pages"]
    assert pruned["event"]["source"] == "explicit" and pruned["regions"][0]["index"] == user["index"]
    assert after["regions"][1]["pruned"] and after["regions"][1]["kept_tokens"] == 0
    assert after["pruned_intervals"] == [[user["start"], user["end"]]]
    _resumed_only_new(_turn(client, cid, [{"role": "user", "content": "And now?"}]))

    # a selector, keeping half of the tool result by the knorm scorer
    before = _chain(client, cid)
    tool = next(r for r in before["regions"] if r["kind"] == "tool_result")
    r = client.post(f"/v1/chains/{cid}/prune", json={"tool_names": ["get_weather"], "kinds": ["tool_result"],
                                                      "scorer": "knorm", "keep_ratio": 0.5})
    assert r.status_code == 200, r.text
    pruned = r.json()
    size = tool["end"] - tool["start"]
    assert pruned["event"]["regions"] == [tool["index"]]
    assert pruned["tokens_freed"] == round(0.5 * size)
    (region,) = pruned["regions"]
    assert region["pruned"] and region["kept_tokens"] == size - round(0.5 * size)
    assert before["kv"]["pages"] - _chain(client, cid)["kv"]["pages"] == pruned["pages_freed"]
    _resumed_only_new(_turn(client, cid, [{"role": "user", "content": "Still there?"}]))


def test_fork_and_rewind_continue_and_equal_a_fresh_engine(client, model_dir):
    cid = _create(client, metadata={"name": "parent"})
    for text in ("one", "two", "three"):
        _turn(client, cid, [{"role": "user", "content": text}])
    parent = _chain(client, cid, tokens=True)

    r = client.post(f"/v1/chains/{cid}/fork", json={"metadata": {"name": "child"}})
    assert r.status_code == 201, r.text
    child = r.json()
    fid = child["id"]
    assert fid != cid and child["parent_id"] == cid and child["metadata"] == {"name": "child"}
    forked = _chain(client, fid, tokens=True)
    for key in ("token_ids", "regions", "turns", "num_turns", "num_tokens", "system_prompt", "tools"):
        assert forked[key] == parent[key], key
    assert forked["kv"]["pages"] == parent["kv"]["pages"] > 0
    assert client.post(f"/v1/chains/{cid}/fork").status_code == 201  # no body: the parent's metadata

    fork_turn = _turn(client, fid, [{"role": "user", "content": "fork four"}])
    _resumed_only_new(fork_turn)
    assert _chain(client, cid)["num_turns"] == 3  # the parent is untouched

    boundary = parent["turns"][0]["usage"]["prompt_tokens"] + parent["turns"][0]["usage"]["completion_tokens"]
    _error(client.post(f"/v1/chains/{cid}/rewind", json={"num_tokens": boundary + 1}), 400, "num_tokens")
    _error(client.post(f"/v1/chains/{cid}/rewind", json={"num_tokens": boundary, "num_turns": 1}), 400, "num_turns")
    _error(client.post(f"/v1/chains/{cid}/rewind", json={"num_turns": 9}), 400, "num_turns")
    r = client.post(f"/v1/chains/{cid}/rewind", json={"num_tokens": boundary})
    assert r.status_code == 200, r.text
    rewound = _chain(client, cid, tokens=True)
    assert rewound["num_turns"] == 1 and rewound["num_tokens"] == boundary
    assert rewound["token_ids"] == parent["token_ids"][:boundary]
    assert [x["turn"] for x in rewound["regions"]] == [0, 0, 0] and rewound["regions"][-1]["end"] == boundary
    assert rewound["kv"]["computed_tokens"] == boundary
    again = _turn(client, cid, [{"role": "user", "content": "rewound two"}])
    assert again["turn"] == 1 and again["resume_status"] == "resumed"
    assert again["usage"]["prefilled_tokens"] == again["usage"]["appended_tokens"]

    engine = make_engine(model_dir)  # the independent check: a bare engine on the same token history
    for chain_id in (fid, cid):
        chain = _chain(client, chain_id, tokens=True)
        assert chain["token_ids"][:len(chain["token_ids"])] == [
            t for turn in chain["turns"] for t in turn["appended_token_ids"] + turn["generated_token_ids"]]
        for turn in chain["turns"]:
            prompt = chain["token_ids"][:turn["usage"]["prompt_tokens"]]
            assert generate_direct(engine, prompt, SAMPLING["max_tokens"]) == turn["generated_token_ids"]

    r = client.post(f"/v1/chains/{cid}/rewind", json={"num_turns": 0})
    assert r.status_code == 200 and r.json()["num_turns"] == 0 and r.json()["regions"] == []
    assert _turn(client, cid, [{"role": "user", "content": "from scratch"}])["turn"] == 0


def test_websocket_turns_stream_deltas_turn_end_and_prune_events(client):
    cid = _create(client, prune_policy={"lag": 0})
    with client.websocket_connect(f"/v1/chains/{cid}/ws") as ws:
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "Weather?"}],
                                 "assistant_prefix": TOOL_CALL, "sampling": {"max_tokens": 8}}))
        first = _ws_turn(ws)
        deltas, end, prunes = first
        assert end["message"]["content"] == TOOL_CALL + "".join(d["text"] for d in deltas) and prunes == []
        call_id = end["message"]["tool_calls"][0]["id"]
        ws.send_text(json.dumps({"messages": [_tool(call_id, 0)], "sampling": {"max_tokens": 16}}))
        deltas, end, prunes = _ws_turn(ws)
        assert len(deltas) >= 1 and "".join(d["text"] for d in deltas) == end["message"]["content"]
        assert end["usage"]["completion_tokens"] == 16 and end["turn"] == 1
        assert [{k: v for k, v in p.items() if k != "type"} for p in prunes] == end["pruned"] and len(prunes) == 1
        turn = _chain(client, cid, tokens=True)["turns"][1]
        assert [t for d in deltas for t in d["token_ids"]] == turn["generated_token_ids"]

        ws.send_text("{not json")
        assert ws.receive_json()["type"] == "error"
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "sampling": {"max_tokens": 0}}))
        err = ws.receive_json()
        assert err["type"] == "error" and err["status_code"] == 400
        assert "sampling.max_tokens" in [d["key"] for d in err["extra"]]
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "still serving"}], "sampling": SAMPLING}))
        assert _ws_turn(ws)[1]["turn"] == 2
    with client.websocket_connect("/v1/chains/chain_nope/ws") as ws:
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}))
        err = ws.receive_json()
        assert (err["type"], err["status_code"]) == ("error", 404)


def _ws_turn(ws):
    deltas, prunes, end = [], [], None
    while True:
        m = ws.receive_json()
        assert m["type"] != "error", m
        if m["type"] == "delta":
            assert end is None
            deltas.append(m)
        elif m["type"] == "turn_end":
            end = m
            if not m["pruned"]:
                return deltas, end, prunes
        elif m["type"] == "prune":
            prunes.append(m)
            if len(prunes) == len(end["pruned"]):
                return deltas, end, prunes


def test_errors_404_409_400(client):
    for route, body in (("prune", {"kinds": ["user"]}), ("fork", {}), ("rewind", {"num_turns": 0})):
        _error(client.post(f"/v1/chains/chain_nope/{route}", json=body), 404)
    cid = _create(client)
    _turn(client, cid, [{"role": "user", "content": "hello there"}])
    n = _chain(client, cid)["kv"]["computed_tokens"]
    prune = f"/v1/chains/{cid}/prune"
    _error(client.post(prune, json={"intervals": [[0, n + 1]]}), 400, "intervals[0]")
    _error(client.post(prune, json={"intervals": [[5, 5]]}), 400, "intervals[0]")
    _error(client.post(prune, json={"intervals": [[3, 4], [9, 2]]}), 400, "intervals[1]")
    _error(client.post(prune, json={"intervals": [[-1, 4]]}), 400, "intervals[0][0]")
    _error(client.post(prune, json={"intervals": [[1, 2, 3]]}), 400, "intervals[0]")
    _error(client.post(prune, json={"intervals": []}), 400, "intervals")
    _error(client.post(prune, json={}), 400, "intervals")
    _error(client.post(prune, json={"intervals": [[0, 2]], "kinds": ["user"]}), 400, "intervals")
    _error(client.post(prune, json={"regions": [99]}), 400, "regions[0]")
    _error(client.post(prune, json={"kinds": ["robot"]}), 400, "kinds[0]")
    _error(client.post(prune, json={"kinds": ["user"], "keep_ratio": 0.5}), 400, "scorer")
    _error(client.post(prune, json={"kinds": ["user"], "keep_ratio": 2}), 400, "keep_ratio")
    _error(client.post(prune, json={"kinds": ["user"], "keep_tokens": 3}), 400, "scorer")
    _error(client.post(prune, json={"kinds": ["user"], "keep_tokens": -3}), 400, "keep_tokens")
    _error(client.post(prune, json={"kinds": ["user"], "scorer": "knorm", "keep_tokens": 3, "keep_ratio": 0.5}),
           400, "keep_tokens")
    _error(client.post("/v1/chains", json={"prune_policy": {"keep_tokens": 4}}), 400, "prune_policy.scorer")
    _error(client.post(prune, json={"kinds": ["user"], "scorer": "no-such-scorer"}), 400, "scorer")
    _error(client.post(prune, json={"kinds": ["user"], "intervalz": []}), 400, "intervalz")
    _error(client.post("/v1/chains", json={"prune_policy": {"lag": -1}}), 400, "prune_policy.lag")
    _error(client.post("/v1/chains", json={"prune_policy": {"lagg": 1}}), 400, "prune_policy.lagg")
    _error(client.post("/v1/chains", json={"prune_policy": {"scorer": "nope"}}), 400, "prune_policy.scorer")
    _error(client.post(f"/v1/chains/{cid}/rewind", json={}), 400, "num_turns")
    _error(client.post(f"/v1/chains/{cid}/fork", json={"metadata": 3}), 400, "metadata")
    assert not any(r["pruned"] for r in _chain(client, cid)["regions"])

    # a chain with a turn in flight: 409 for prune, fork, rewind and a second turn
    with client.websocket_connect(f"/v1/chains/{cid}/ws") as ws:
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "long"}],
                                 "sampling": {"max_tokens": 400, "ignore_eos": True}}))
        assert ws.receive_json()["type"] == "delta"
        _error(client.post(prune, json={"kinds": ["user"]}), 409)
        _error(client.post(f"/v1/chains/{cid}/fork", json={}), 409)
        _error(client.post(f"/v1/chains/{cid}/rewind", json={"num_turns": 0}), 409)
        _error(client.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "x"}]}), 409)
        while ws.receive_json()["type"] != "turn_end":
            pass
    assert client.post(prune, json={"kinds": ["user"]}).status_code == 200


def test_after_a_restart_pruning_persists_until_the_recomputed_turn(client, model_dir, db_url):
    cid = _create(client, prune_policy={"lag": 0, "exclude_tools": ["search"]})
    first = _turn(client, cid, [{"role": "user", "content": "go"}], assistant_prefix=TOOL_CALL)
    assert len(_turn(client, cid, [_tool(first["message"]["tool_calls"][0]["id"], 0)])["pruned"]) == 1
    before = _chain(client, cid)
    app = create_app(ServerConfig(model=model_dir, db_url=db_url, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as fresh:
        after = _chain(fresh, cid)
        for key in ("regions", "prune_policy", "pruned_intervals", "prune_events"):
            assert after[key] == before[key], key
        assert not after["kv"]["resident"]
        result = _turn(fresh, cid, [{"role": "user", "content": "again"}])
        assert result["resume_status"] == "recomputed"
        chain = _chain(fresh, cid)
        assert chain["pruned_intervals"] == [] and not any(r["pruned"] for r in chain["regions"])
        assert all(r["kept_tokens"] == r["end"] - r["start"] for r in chain["regions"])
