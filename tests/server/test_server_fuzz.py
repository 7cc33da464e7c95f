""">= 500 malformed or hostile requests against the real app: no 5xx, nothing leaks across tenants, the server
still serves a normal turn afterwards. Deterministic: every request comes from one seeded generator."""

from __future__ import annotations

import json
import random
from urllib.parse import quote

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, WEATHER_TOOL, bearer, make_keys

SEED = 20261201
NUM_HTTP = 560
NUM_WS = 60
BODY_LIMIT = 32 * 1024
MAX_TOKENS = 6

WEIRD_STRINGS = ["", " ", "\x00", "a\x00b", "\u202e\u202dRTL\u200f", "\u200b\ufeff", "e\u0301\u0301\u0301", "😀" * 50,
                 "\uffff", "\U0010ffff", "<|im_end|>", "<tool_call>{\"name\": 1}</tool_call>", "{{ raise }}",
                 "{% for x in y %}", "\\", "'; DROP TABLE chains; --", "%00", "../../etc/passwd", "\r\n\r\n",
                 "x" * 5000, "chain_" + "0" * 32, "\u0661\u0662\u0663", "ﷺ", "\t"]
# raw JSON string literals (escaped lone surrogates and friends) spliced into bodies as text
RAW_STRINGS = ['"\\ud800"', '"\\udc00x"', '"\\ud83d"', '"\\u0000"', '"\\u202e"', '"\\uZZZZ"', '"\\x41"', '"\\', '"a\nb"']
HUGE = [10**30, -(10**30), 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 2**31, -1, 0, 1.5, 1e-320]
ROUTES = ["/v1/chains", "/v1/chains/{id}", "/v1/chains/{id}/turns", "/v1/chains/{id}/prune", "/v1/chains/{id}/fork",
          "/v1/chains/{id}/rewind", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]


def valid_bodies(model: str) -> dict[str, dict]:
    return {
        "/v1/chains": {"system_prompt": "Be brief.", "tools": [WEATHER_TOOL], "metadata": {"k": "v"},
                       "prune_policy": {"lag": 1, "keep_ratio": 0.0, "min_tool_tokens": 0, "exclude_tools": []}},
        "/v1/chains/{id}/turns": {"messages": [{"role": "user", "content": "hi"},
                                               {"role": "tool", "tool_call_id": "c1", "content": "{}"}],
                                  "assistant_prefix": "ok", "stream": False,
                                  "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 1,
                                               "max_tokens": 2, "stop": ["x"], "stop_token_ids": [1],
                                               "ignore_eos": False}},
        "/v1/chains/{id}/prune": {"intervals": [[0, 2]], "keep_ratio": 0.0},
        "/v1/chains/{id}/fork": {"metadata": {"branch": "b"}},
        "/v1/chains/{id}/rewind": {"num_turns": 0},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                 "temperature": 0},
    }


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice(HUGE)
    if kind == 1:
        return rng.choice(WEIRD_STRINGS)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return rng.randint(-5, 5)
    if kind == 4:
        return rng.random() * rng.choice([1, -1, 1e6])
    if kind == 5:
        return []
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {rng.choice(WEIRD_STRINGS + ["role", "content", "intervals"]): _random_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return [[rng.choice(HUGE + [0, 1, 3]), rng.choice(HUGE + [0, 1, 3])]]


def _mutate(rng: random.Random, body):
    """One random change somewhere in a JSON document: a wrong type, a removed field, an unknown field."""
    if isinstance(body, dict) and body and rng.random() < 0.8:
        key = rng.choice(list(body))
        op = rng.randrange(5)
        body = dict(body)
        if op == 0:
            del body[key]
        elif op == 1:
            body[rng.choice(["unknown", "Messages", "max_tokens", "\u202eevil", "__proto__"])] = _random_value(rng)
        elif op in (2, 3):
            body[key] = _mutate(rng, body[key])
        else:
            body[key] = _random_value(rng)
        return body
    if isinstance(body, list) and body and rng.random() < 0.7:
        body = list(body)
        i = rng.randrange(len(body))
        body[i] = _mutate(rng, body[i]) if rng.random() < 0.6 else _random_value(rng)
        if rng.random() < 0.2:
            body.extend(body * rng.randrange(1, 3))
        return body
    return _random_value(rng)


def _intervals(rng: random.Random) -> list:
    lo, hi = rng.randrange(-10, 50), rng.randrange(-10, 50)
    return rng.choice([[[lo, hi]], [[hi, lo]], [[lo, lo]], [[-1, 5]], [[5, 2]], [[0]], [[0, 1, 2]], [[0, 10**20]],
                       [[0, 1]] * 5000, [], [[1.5, 2]], [["0", "1"]], [[0, 2**64]], [[lo, hi], [hi, lo]]])


class Fuzzer:
    def __init__(self, rng: random.Random, model: str, own: str, victim: str, keys: dict[str, str]):
        self.rng, self.own, self.victim, self.keys = rng, own, victim, keys
        self.valid = valid_bodies(model)

    def chain_id(self) -> str:
        rng = self.rng
        return rng.choice([self.own, self.own, self.victim, self.victim, "chain_" + "f" * 32, "", "%00",
                           quote(rng.choice(WEIRD_STRINGS), safe=""), "x" * 300, "..", "%2e%2e", "%F0%9F%98%80",
                           quote("\ud800", safe="", errors="surrogatepass")])

    def headers(self) -> dict[str, str]:
        rng = self.rng
        h = {"Content-Type": "application/json"}
        r = rng.random()
        if r < 0.85:
            h.update(bearer(self.keys["alice"]))
        elif r < 0.9:
            h["Authorization"] = rng.choice(["Bearer", "Bearer ", "bearer art_", "Basic x", "Bearer " + "a" * 9000,
                                             "Bearer art_0123456789abcdef_" + "A" * 43])
        elif r < 0.95:
            h["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                            "application/json; charset=latin-1", ""])
            h.update(bearer(self.keys["alice"]))
        return h

    def body(self, route: str) -> bytes | None:
        rng = self.rng
        valid = self.valid.get(route)
        kind = rng.randrange(11)
        if kind == 0:  # not JSON at all
            return rng.choice([b"", b"{", b"[1,2", b"nul", b"{'a': 1}", b"\xff\xfe\x00", b"\xef\xbb\xbf{}",
                               b'{"a":1}{"b":2}', b"NaN", b"Infinity", b"-", b'{"messages": [}', bytes(range(256)),
                               b"{" * 10_000, b"[" * 3000 + b"]" * 3000])
        if kind == 1:  # oversized
            return b'{"messages": [{"role": "user", "content": "' + b"A" * (BODY_LIMIT + rng.randrange(1, 5000)) + b'"}]}'
        if kind == 2 and valid is not None:  # a raw string literal spliced in (escaped lone surrogates, ...)
            text = json.dumps(valid)
            spots = [i for i, c in enumerate(text) if c == '"']
            i = rng.choice(spots)
            j = text.find('"', i + 1)
            return (text[:i] + rng.choice(RAW_STRINGS) + text[j + 1:]).encode("utf-8", "surrogatepass")
        if kind == 3 and route.endswith("/prune"):
            return json.dumps({"intervals": _intervals(rng), **({"keep_ratio": rng.choice(HUGE)}
                                                                if rng.random() < 0.3 else {})}).encode()
        if kind == 4 and route.endswith("/turns"):  # huge or odd numbers in sampling
            sampling = {rng.choice(["max_tokens", "seed", "top_k", "top_p", "temperature", "min_p"]): rng.choice(HUGE)}
            return json.dumps({"messages": [{"role": "user", "content": rng.choice(WEIRD_STRINGS)}],
                               "sampling": sampling}).encode()
        if kind == 5 and route.endswith("/turns"):  # odd messages
            message = rng.choice([{"role": "system", "content": "x"}, {"role": "assistant", "content": "x"},
                                  {"role": "tool", "content": "x"}, {"role": "tool", "tool_call_id": "", "content": ""},
                                  {"role": "user"}, {"content": "x"}, {"role": None, "content": "x"},
                                  {"role": "user", "content": rng.choice(WEIRD_STRINGS)},
                                  {"role": "tool", "tool_call_id": rng.choice(WEIRD_STRINGS) or "id",
                                   "name": rng.choice(WEIRD_STRINGS), "content": rng.choice(WEIRD_STRINGS)}])
            return json.dumps({"messages": [message] * rng.choice([0, 1, 2, 1025]),
                               "sampling": {"max_tokens": rng.choice([1, MAX_TOKENS, MAX_TOKENS + 1])}}).encode()
        if kind == 6:
            return json.dumps(_random_value(rng)).encode()
        if valid is None:
            return None if rng.random() < 0.5 else json.dumps(_random_value(rng)).encode()
        if kind == 7:
            return json.dumps(valid).encode()  # valid, but maybe on another tenant's chain or the wrong method
        return json.dumps(_mutate(rng, valid), ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")

    def request(self) -> tuple[str, str, bytes | None, dict[str, str], str]:
        rng = self.rng
        route = rng.choice(ROUTES)
        cid = self.chain_id()
        path = route.replace("{id}", cid)
        if rng.random() < 0.1:
            path += rng.choice(["?offset=-1", "?limit=0", "?limit=101", "?limit=abc", "?offset=99999999999999999999",
                                "?include_tokens=maybe", "?include_tokens=true", "?offset=1&limit=1", "?%00=%ff"])
        if route in ("/v1/chains", "/v1/chains/{id}"):
            method = rng.choice(["GET", "POST", "DELETE", "PUT", "PATCH"])
        elif route in ("/v1/models", "/health", "/metrics"):
            method = rng.choice(["GET", "GET", "POST", "DELETE"])
        else:
            method = rng.choice(["POST"] * 6 + ["GET", "PUT", "DELETE", "OPTIONS"])
        return method, path, self.body(route), self.headers(), cid


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory):
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'fuzz.db'}"
    keys = make_keys(db_url, "alice", "bob")
    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS, require_auth=True,
                          max_body_size=BODY_LIMIT, max_tokens_per_turn=MAX_TOKENS, max_chains_per_tenant=40)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60, raise_server_exceptions=False) as client:
        yield client, keys


def test_hostile_requests_never_5xx_and_the_server_still_serves(fuzz_app):
    client, keys = fuzz_app
    alice, bob = bearer(keys["alice"]), bearer(keys["bob"])
    model = client.app.state.model_name

    def chain(headers) -> str:
        r = client.post("/v1/chains", json={"tools": [WEATHER_TOOL]}, headers=headers)
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        r = client.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "hello"}],
                                                         "sampling": {"max_tokens": 3}}, headers=headers)
        assert r.status_code == 200, r.text
        return cid

    own, victim = chain(alice), chain(bob)  # alice attacks bob's chain; she may change her own
    victim_before = client.get(f"/v1/chains/{victim}?include_tokens=true", headers=bob).json()
    rng = random.Random(SEED)
    fuzzer = Fuzzer(rng, model, own, victim, keys)
    statuses: dict[int, int] = {}
    failures = []
    for i in range(NUM_HTTP):
        method, path, body, headers, cid = fuzzer.request()
        r = client.request(method, path, content=body, headers=headers)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            failures.append((i, method, path, (body or b"")[:300], r.status_code, r.text[:300]))
        elif cid == victim and "Authorization" in headers and headers["Authorization"] == alice["Authorization"] \
                and path.startswith(f"/v1/chains/{victim}") and method != "OPTIONS" \
                and r.status_code not in (404, 405, 413):
            # another tenant's chain: nothing but 404 (or a refusal that precedes any lookup)
            if not (r.status_code in (400, 415) and method == "POST"):
                failures.append((i, method, path, (body or b"")[:300], r.status_code, "leak: " + r.text[:300]))
        if r.status_code < 500 and r.headers.get("content-type", "").startswith("application/json") and r.content:
            payload = r.json()
            if r.status_code >= 400 and path.split("?")[0].startswith(("/v1/chat/completions", "/v1/models")):
                assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
            elif r.status_code >= 400:
                assert set(payload) <= {"status_code", "detail", "extra"} and payload["status_code"] == r.status_code
    assert not failures, failures[:10]
    assert sum(statuses.values()) == NUM_HTTP
    assert statuses.get(400, 0) > 50 and statuses.get(404, 0) > 20 and statuses.get(413, 0) > 10, statuses
    assert statuses.get(405, 0) > 5 and statuses.get(401, 0) > 5, statuses

    # WebSocket: garbage frames give error messages (never 5xx) and the socket stays usable
    ws_statuses = []
    ws_chain = chain(alice)  # the HTTP fuzz may have deleted alice's first chain
    with client.websocket_connect(f"/v1/chains/{ws_chain}/ws", headers=alice) as ws:
        for _ in range(NUM_WS):
            body = fuzzer.body("/v1/chains/{id}/turns") or b"{}"
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError:
                text = body.decode("latin-1")
            ws.send_text(text)
            while True:
                msg = ws.receive_json()
                if msg["type"] in ("turn_end", "error"):
                    break
            if msg["type"] == "error":
                ws_statuses.append(msg["status_code"])
        assert all(s < 500 for s in ws_statuses), ws_statuses
        ws.send_text(json.dumps({"messages": [{"role": "user", "content": "still there?"}],
                                 "sampling": {"max_tokens": 2}}))
        msgs = [ws.receive_json()]
        while msgs[-1]["type"] == "delta":
            msgs.append(ws.receive_json())
        assert msgs[-1]["type"] == "turn_end", msgs

    # nothing alice sent touched bob's chain, and everyone is still served normally
    assert client.get(f"/v1/chains/{victim}?include_tokens=true", headers=bob).json() == victim_before
    assert client.get("/health").status_code == 200
    fresh = chain(alice)
    r = client.post(f"/v1/chains/{fresh}/turns", json={"messages": [{"role": "user", "content": "Weather?"}],
                                                       "sampling": {"max_tokens": MAX_TOKENS}}, headers=alice)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = client.post(f"/v1/chains/{victim}/turns", json={"messages": [{"role": "user", "content": "Still mine?"}],
                                                        "sampling": {"max_tokens": 2}}, headers=bob)
    assert r.status_code == 200 and r.json()["resume_status"] == "resumed", r.text
    assert not client.app.state.worker.inflight and not client.app.state.chains.busy
