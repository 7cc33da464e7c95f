"""The published OpenAPI document (``/schema/openapi.json``): generated from the route signatures and the wire
types, it says what the server does (tests/server/test_openapi_schemathesis.py checks the server against it)."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
import schemathesis
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, bearer, make_keys

SCHEMAS = "#/components/schemas/"
CHAIN = {"post /v1/chains": {201, 400, 401, 413, 415, 422, 429},
         "get /v1/chains": {200, 400, 401},
         "get /v1/chains/{chain_id}": {200, 400, 401, 404},
         "delete /v1/chains/{chain_id}": {204, 400, 401, 404, 409},  # 400: Litestar's, for any parameter
         "post /v1/chains/{chain_id}/turns": {200, 400, 401, 404, 409, 413, 415, 422, 503},
         "post /v1/chains/{chain_id}/prune": {200, 400, 401, 404, 409, 413, 415},
         "post /v1/chains/{chain_id}/fork": {201, 400, 401, 404, 409, 413, 415, 429},
         "post /v1/chains/{chain_id}/rewind": {200, 400, 401, 404, 409, 413, 415},
         "post /v1/chains/{chain_id}/hints": {200, 400, 401, 404, 409, 413, 415}}
OPENAI = {"post /v1/chat/completions": {200, 400, 401, 404, 409, 413, 415, 503},
          "post /v1/completions": {200, 400, 401, 404, 413, 415, 503},
          "post /v1/responses": {200, 400, 401, 404, 409, 413, 415, 429, 503},
          "get /v1/responses/{response_id}": {200, 400, 401, 404},
          "delete /v1/responses/{response_id}": {200, 400, 401, 404},
          "get /v1/responses/{response_id}/input_items": {200, 400, 401, 404},
          "post /v1/conversations": {200, 400, 401, 413, 415, 429},
          "get /v1/conversations/{conversation_id}": {200, 400, 401, 404},
          "post /v1/conversations/{conversation_id}": {200, 400, 401, 404, 413, 415},
          "delete /v1/conversations/{conversation_id}": {200, 400, 401, 404, 409},
          "get /v1/conversations/{conversation_id}/items": {200, 400, 401, 404},
          "post /v1/conversations/{conversation_id}/items": {200, 400, 401, 404, 413, 415},
          "get /v1/conversations/{conversation_id}/items/{item_id}": {200, 400, 401, 404},
          "delete /v1/conversations/{conversation_id}/items/{item_id}": {200, 400, 401, 404, 409},
          "get /v1/models": {200, 401},
          "get /v1/models/{model_id}": {200, 400, 401, 404}}
ANTHROPIC = {"post /v1/messages": {200, 400, 401, 404, 409, 413, 415, 429, 503},
             "post /v1/messages/count_tokens": {200, 400, 401, 404, 413, 415}}
PUBLIC = {"get /health": {200}, "get /metrics": {200}}


def _document(client: TestClient, headers: dict[str, str] | None = None) -> dict:
    r = client.get("/schema/openapi.json", headers=headers)
    assert r.status_code == 200, r.text
    assert client.get("/schema/openapi.yaml", headers=headers).status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('openapi-doc') / 'keys.db'}"
    auth = bearer(make_keys(db_url, "alice")["alice"])
    config = ServerConfig(model=random_model_dir(), model_name="tiny", db_url=db_url, engine_options=ENGINE_OPTIONS,
                          require_auth=True, max_tokens_per_turn=64)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as client:
        yield client, auth


@pytest.fixture(scope="module")
def with_keys(served):
    client, auth = served
    return _document(client, auth)


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('openapi-doc') / 'keyless.db'}"
    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as client:
        return _document(client)


def _operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield f"{method} {path}", operation


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].removeprefix(SCHEMAS)]
    return schema


def _refs(node) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _reachable(doc: dict, roots) -> dict[str, dict]:
    seen: dict[str, dict] = {}
    todo = [r for r in _refs(list(roots))]
    while todo:
        name = todo.pop().removeprefix(SCHEMAS)
        if name not in seen:
            seen[name] = doc["components"]["schemas"][name]
            todo.extend(_refs(seen[name]))
    return seen


def test_info_and_a_valid_document(with_keys):
    info = with_keys["info"]
    assert info["title"] == "agentrt" and info["version"] and "chains" in info["description"]
    assert with_keys["openapi"].startswith("3.1")
    names = set(with_keys["components"]["schemas"])
    assert {ref.removeprefix(SCHEMAS) for ref in _refs(with_keys)} <= names  # no dangling reference
    for name, schema in with_keys["components"]["schemas"].items():
        jsonschema_rs.meta.validate(schema)  # each component is a valid JSON Schema (2020-12, as OpenAPI 3.1's)
    loaded = schemathesis.openapi.from_dict(with_keys)
    labels = {op.ok().label for op in loaded.get_all_operations()}
    assert labels == {f"{method.upper()} {path}" for method, path in (k.split(" ", 1) for k in {
        **CHAIN, **OPENAI, **ANTHROPIC, **PUBLIC})}


def test_request_bodies_forbid_unknown_fields(with_keys):
    bodies = [op["requestBody"]["content"]["application/json"]["schema"] for _, op in _operations(with_keys)
              if "requestBody" in op]
    # create, turns, prune, fork, rewind, hints, chat completions, text completions, responses, messages,
    # count_tokens, conversations: create, update, add items
    assert len(bodies) == 14
    structs = {name: s for name, s in _reachable(with_keys, bodies).items() if s.get("properties")}
    assert {"ChainCreate", "TurnCreate", "Sampling", "PrunePolicy", "PruneRequest", "ForkRequest", "RewindRequest", "HintsRequest",
            "ChatCompletionRequest", "StreamOptions", "TextPart", "sdk.schema.UserMessage", "ToolResultMessage",
            "agentrt.openai_types.Tool", "agentrt.openai_types.FunctionDef", "TextCompletionRequest",
            "ResponsesRequest", "TextConfig", "MessagesRequest", "MessageParam", "CountTokensRequest",
            "ConversationCreate", "ConversationUpdate", "ItemsCreate"} <= set(structs)
    # every struct a request takes forbids unknown fields, the OpenAI and Anthropic ones included; ToolCall (echoed
    # back by clients inside an assistant message) is the server's own output type and takes extra fields, and the
    # Anthropic blocks this server refuses by type (images, documents, ...) are read with any fields, so that the
    # 400 names the type (agentrt.anthropic_types)
    from agentrt.anthropic_types import _Refused

    refused = {cls.__name__ for cls in _Refused.__subclasses__()}
    assert {name for name, s in structs.items() if s.get("additionalProperties") is not False} - refused \
        == {"ToolCall", "FunctionCall"}
    fork = next(op for key, op in _operations(with_keys) if key == "post /v1/chains/{chain_id}/fork")
    assert fork["requestBody"]["required"] is False  # the body is optional
    assert next(op for key, op in _operations(with_keys) if key == "post /v1/chains")["requestBody"]["required"]


def test_types_as_the_strict_decoder_reads_them(with_keys):
    schemas = with_keys["components"]["schemas"]
    assert schemas["TurnCreate"]["properties"]["stream"] == {"type": "boolean", "default": False}
    assert schemas["ChatCompletionRequest"]["properties"]["stream"]["anyOf"] == [{"type": "boolean"},
                                                                                 {"type": "null"}]
    seed = schemas["Sampling"]["properties"]["seed"]["anyOf"][0]
    assert seed == {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
    assert schemas["Sampling"]["properties"]["stop"]["items"] == {"type": "string", "minLength": 1}
    # the server's own limit on max_tokens: a chain turn refuses a larger value (unless fit_max_tokens, as its
    # description says); the foreign APIs lower it, so no schema maximum there
    assert schemas["Sampling"]["properties"]["max_tokens"]["maximum"] == 64
    assert "at most 64 tokens" in schemas["Sampling"]["properties"]["max_tokens"]["description"]
    assert "maximum" not in schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert "lowered" in schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["description"]
    vocab = json.loads((random_model_dir() / "config.json").read_text())["vocab_size"]  # forced ids below it
    assert schemas["Sampling"]["properties"]["forced_token_ids"]["items"]["maximum"] == vocab - 1
    assert schemas["ChatCompletionRequest"]["properties"]["forced_token_ids"]["anyOf"][0]["items"]["maximum"] \
        == vocab - 1
    # tagged unions carry their discriminator
    messages = schemas["TurnCreate"]["properties"]["messages"]["items"]
    assert messages["discriminator"]["propertyName"] == "role"
    # the served model's name: the only one a chain takes (400 otherwise), an example where another is a 404
    assert schemas["ChainCreate"]["properties"]["model"]["anyOf"] == [{"type": "string", "enum": ["tiny"]},
                                                                      {"type": "null"}]
    assert schemas["ChatCompletionRequest"]["properties"]["model"] == {"type": "string", "examples": ["tiny"]}
    model_id = with_keys["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]
    assert model_id["name"] == "model_id" and model_id["schema"]["examples"] == ["tiny"]


def test_documented_statuses_and_error_bodies(with_keys):
    operations = dict(_operations(with_keys))
    assert set(operations) == set(CHAIN) | set(OPENAI) | set(ANTHROPIC) | set(PUBLIC)
    for key, statuses in {**CHAIN, **OPENAI, **ANTHROPIC, **PUBLIC}.items():
        responses = operations[key]["responses"]
        assert {int(s) for s in responses} == statuses, key
        family = ("agentrt.openai_types.ErrorResponse" if key in OPENAI else
                  "agentrt.anthropic_types.ErrorResponse" if key in ANTHROPIC else "ErrorBody")
        for status, response in responses.items():
            if int(status) >= 400:
                assert response["content"]["application/json"]["schema"] == {"$ref": SCHEMAS + family}, (key, status)
                assert response["description"]
        if 401 in statuses:
            assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True
        if 503 in statuses:
            assert "Retry-After" in responses["503"]["headers"]
    assert operations["get /metrics"]["responses"]["200"]["content"].keys() == {"text/plain; version=1.0.0"}
    assert operations["post /v1/chains"]["responses"]["201"]["content"]["application/json"]["schema"] \
        == {"$ref": SCHEMAS + "ChainRead"}


def test_streaming_routes_describe_their_events(with_keys):
    operations = dict(_operations(with_keys))
    turn = operations["post /v1/chains/{chain_id}/turns"]["responses"]["200"]["content"]
    assert turn["application/json"]["schema"] == {"$ref": SCHEMAS + "TurnResult"}
    events = {e["properties"]["event"]["const"]: e["properties"]["data"]["contentSchema"]
              for e in turn["text/event-stream"]["schema"]["anyOf"]}
    assert events == {"delta": {"$ref": SCHEMAS + "TurnDelta"}, "done": {"$ref": SCHEMAS + "TurnResult"},
                      "error": {"$ref": SCHEMAS + "ErrorBody"}}
    chunk = operations["post /v1/chat/completions"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert chunk["required"] == ["data"] and chunk["properties"]["data"]["if"] == {"enum": ["[DONE]"]}
    validator = jsonschema_rs.validator_for({**chunk, "$defs": with_keys["components"]["schemas"]})
    assert validator.is_valid({"event": "message", "data": "[DONE]"})


def test_links_from_a_created_chain(with_keys):
    operations = dict(_operations(with_keys))
    for key in ("post /v1/chains", "post /v1/chains/{chain_id}/fork"):
        links = operations[key]["responses"]["201"]["links"]
        targets = {link["operationId"] for link in links.values()}
        assert targets == {op["operationId"] for k, op in operations.items() if "{chain_id}" in k}
        assert {json.dumps(link["parameters"]) for link in links.values()} == {'{"chain_id": "$response.body#/id"}'}


def test_security(with_keys, keyless):
    scheme = with_keys["components"]["securitySchemes"]["bearerApiKey"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    assert with_keys["security"] == [{"bearerApiKey": []}]  # required
    assert keyless["security"] == [{"bearerApiKey": []}, {}]  # optional on a keyless loopback server
    for doc in (with_keys, keyless):
        operations = dict(_operations(doc))
        assert operations["get /health"]["security"] == [] and operations["get /metrics"]["security"] == []
    # a keyless loopback server answers only to loopback names: a 400 on every route, the public ones too
    keyless_ops = dict(_operations(keyless))
    assert "Host" in keyless_ops["get /health"]["responses"]["400"]["description"]
    assert "400" not in dict(_operations(with_keys))["get /health"]["responses"]
    assert "local" in keyless_ops["get /v1/chains"]["responses"]["401"]["description"]


def test_what_the_document_refuses_the_server_refuses(served, with_keys):
    """Unknown fields (``additionalProperties: false``), a ``stream`` that is not a boolean and a ``max_tokens``
    over the document's maximum are 400s naming the field, on both route families."""
    client, auth = served
    schemas = with_keys["components"]["schemas"]
    chain = client.post("/v1/chains", json={}, headers=auth).json()["id"]
    turn = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2}}
    completion = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, family in ((f"/v1/chains/{chain}/turns", turn, "chain"),
                               ("/v1/chat/completions", completion, "openai")):
        assert client.post(path, json=body, headers=auth).status_code == 200
        for bad, field in (({**body, "bogus": 1}, "bogus"), ({**body, "stream": 0}, "stream"),
                           ({**body, "stream": "true"}, "stream")):
            r = client.post(path, json=bad, headers=auth)
            assert r.status_code == 400, (path, bad, r.text)
            named = r.json()["extra"][0]["key"] if family == "chain" else r.json()["error"]["param"]
            assert named == field, r.text
    limit = 64  # max_tokens_per_turn: a chain turn over it is a 400 unless fit_max_tokens; chat completions lower it
    r = client.post(f"/v1/chains/{chain}/turns", json={**turn, "sampling": {"max_tokens": limit + 1}}, headers=auth)
    assert r.status_code == 400 and r.json()["extra"][0]["key"] == "sampling.max_tokens"
    r = client.post(f"/v1/chains/{chain}/turns", json={**turn, "sampling": {"max_tokens": limit + 1,
                                                                            "fit_max_tokens": True}}, headers=auth)
    assert r.status_code == 200, r.text
    assert client.post("/v1/chat/completions", json={**completion, "max_tokens": 10**6}, headers=auth).status_code \
        == 200
    assert client.post("/v1/chains", json={"model": "other"}, headers=auth).status_code == 400  # enum: the served


def test_text_completions_responses_and_messages(with_keys, keyless, served):
    """The legacy completions, Responses and Messages routes: their limits, events, links, the Messages routes'
    second key header, and the lone tagged structs the decoder reads without their tag."""
    schemas = with_keys["components"]["schemas"]
    operations = dict(_operations(with_keys))
    vocab = json.loads((random_model_dir() / "config.json").read_text())["vocab_size"]
    prompt = schemas["TextCompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]["anyOf"]
    assert [p.get("maximum") or p.get("items", {}).get("maximum") for p in prompt] == [None, vocab - 1, vocab - 1]
    for name, field in (("TextCompletionRequest", "max_tokens"), ("ResponsesRequest", "max_output_tokens"),
                        ("MessagesRequest", "max_tokens")):
        assert "at most 64 tokens" in schemas[name]["properties"][field]["description"]
    for name in ("TextCompletionRequest", "ResponsesRequest", "MessagesRequest", "CountTokensRequest"):
        assert schemas[name]["properties"]["model"]["examples"] == ["tiny"]

    def event_names(key: str) -> set[str]:
        events = operations[key]["responses"]["200"]["content"]["text/event-stream"]["schema"]["anyOf"]
        return {e["properties"]["event"].get("const", e["properties"]["event"].get("pattern")) for e in events}

    from agentrt.anthropic_types import StreamEvent

    assert event_names("post /v1/messages") == {t.__struct_config__.tag for t in StreamEvent.__args__}
    assert {"response.created", "response.completed", "error", r"^response\."} <= event_names("post /v1/responses")
    done = operations["post /v1/completions"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert done["properties"]["data"]["if"] == {"enum": ["[DONE]"]}
    assert done["properties"]["data"]["else"]["contentSchema"]["anyOf"][0] == {"$ref": SCHEMAS + "TextCompletion"}
    for key in ("post /v1/completions", "post /v1/responses", "post /v1/messages"):  # a plain and a streamed one
        examples = operations[key]["requestBody"]["content"]["application/json"]["examples"]
        assert {e["value"]["model"] for e in examples.values()} == {"tiny"}
        assert any(e["value"].get("stream") for e in examples.values())
        for example in examples.values():
            r = served[0].post(key.split(" ")[1], json={**example["value"], "stream": False}, headers=served[1])
            assert r.status_code == 200, r.text
    links = operations["post /v1/responses"]["responses"]["200"]["links"]
    assert {link["operationId"] for link in links.values()} == \
        {op["operationId"] for k, op in operations.items() if "{response_id}" in k}

    # Anthropic's clients send the key as x-api-key: a second scheme on those routes, either one does
    assert with_keys["components"]["securitySchemes"]["headerApiKey"] == {
        **with_keys["components"]["securitySchemes"]["headerApiKey"], "type": "apiKey", "in": "header",
        "name": "x-api-key"}
    assert operations["post /v1/messages"]["security"] == [{"bearerApiKey": []}, {"headerApiKey": []}]
    assert dict(_operations(keyless))["post /v1/messages"]["security"] == [{"bearerApiKey": []},
                                                                           {"headerApiKey": []}, {}]

    # a tagged struct as a field's only type: msgspec decodes it without its tag, and the document says so
    lone = schemas["ClearToolUsesEdit"]["properties"]["clear_at_least"]["anyOf"][0]
    assert lone["title"] == "InputTokens" and lone["required"] == ["value"] and "type" in lone["properties"]
    union = schemas["ClearToolUsesEdit"]["properties"]["trigger"]["anyOf"][0]
    assert union["discriminator"]["propertyName"] == "type"  # in a tagged union the tag stays required
    assert "type" in schemas["InputTokens"]["required"]

    client, auth = served
    for path, body, named in (
            ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}, lambda r: r["error"]["param"]),
            ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
             lambda r: r["error"]["message"].split(":")[0])):
        assert client.post(path, json=body, headers=auth).status_code == 200
        r = client.post(path, json={**body, "bogus": 1}, headers=auth)
        assert r.status_code == 400 and named(r.json()) == "bogus", r.text
        r = client.post(path, json={**body, "max_tokens": 65}, headers=auth)  # lowered to the limit (64)
        assert r.status_code == 200, r.text
