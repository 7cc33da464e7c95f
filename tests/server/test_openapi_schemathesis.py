"""The published OpenAPI document against the server: schemathesis generates requests from
``/schema/openapi.json`` (schema-valid ones and ones that break it) and checks every answer against the same
document, in-process over ASGI, with auth on and a real tenant's key. Every route is in the document: the chain
routes, OpenAI's chat completions, text completions, Responses, Conversations and models, and Anthropic's
Messages (whose ``x-api-key`` header is a second security scheme; the key goes as ``Authorization: Bearer`` here).

All of schemathesis's phases run, as ``st run`` does: the coverage phase (each field's boundary values and
each way to break it, requests without the key, methods the document does not name), fuzzing (hypothesis,
``max-examples`` per operation, derandomized: the same requests every run) and the stateful phase, which
follows the document's links (a created chain's ``id`` is the ``chain_id`` of every chain route, a created
response's the ``response_id`` of the Responses routes, a created conversation's the ``conversation_id`` of the
Conversations routes) so turns, prune, fork, rewind and delete meet real chains, retrieval, input items and delete
real responses, and updates, items and delete real conversations.

Checks: no 5xx; every status, content type and documented header as the document says; every JSON body and
every server-sent event valid against its schema; schema-breaking requests refused (4xx); a request without
the key refused with 401; an undocumented method refused with 405; a deleted chain gone, a created one there.

Excluded, and why:

- ``positive_data_acceptance`` (schema-valid requests must not be refused): the document cannot carry every
  rule. A schema-valid request may be a legitimate 400 because of the data it meets (prune intervals past the
  chain's computed tokens, a rewind to a token count that is not a turn boundary), because of a rule between
  fields (both or neither of ``intervals`` and a region selector; OpenAI fields accepted only at their neutral
  value, refused by name), or because JSON Schema's ``integer`` admits ``899.0`` while the server takes
  integers only written as integers (docs/server.md, "Strict bodies").
- ``allow_header_conformance``: Litestar 2's automatic OPTIONS answer lists only the methods of the first handler
  registered on a path (litestar-org/litestar#4169, fixed in Litestar 3); its 405 answers list them all.
- ``ensure_resource_availability`` on ``/v1/responses/{response_id}`` (and its ``input_items``): a response created
  with ``store: false`` is not retrievable, as with OpenAI (404), yet it is a 200 of ``POST /v1/responses`` whose
  ``id`` the links pass on. Chains keep the check.

Generated turns are cheap: ``max_tokens_per_turn`` 8 (the document's maximum for ``max_tokens``) on the small
random model. A longer run against a live server: docs/server.md ("OpenAPI document").
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import schemathesis
from schemathesis.engine import events, from_schema
from schemathesis.python import asgi as schemathesis_asgi

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, bearer, make_keys

MAX_EXAMPLES = 10  # per operation, in the fuzzing phase; the coverage phase sends its own fixed set


@dataclass
class Run:
    statuses: collections.Counter = field(default_factory=collections.Counter)  # (operation, status, media type)
    checks: collections.Counter = field(default_factory=collections.Counter)  # check name -> times run
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def answered(self, operation: str, status: int, media_type: str = "application/json") -> int:
        return self.statuses[(operation, status, media_type)]


def _run(schema) -> Run:
    run = Run()
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            run.errors.append(f"{getattr(event, 'label', '')}: {getattr(event, 'value', event)!r}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        for case_id, interaction in recorder.interactions.items():
            if interaction.response is None:
                continue
            media_type = (interaction.response.headers.get("content-type") or [""])[0].split(";")[0]
            # the method sent, not the operation's: the coverage phase also sends methods the document does not name
            path = recorder.cases[case_id].value.operation.path
            run.statuses[(f"{interaction.request.method.upper()} {path}", interaction.response.status_code,
                          media_type)] += 1
        for nodes in recorder.checks.values():
            for node in nodes:
                run.checks[node.name] += 1
                if node.failure_info is not None:
                    failure = node.failure_info.failure
                    run.failures.append(f"{recorder.label}: {node.name}: {failure.title}: {failure.message}\n"
                                        f"{node.failure_info.code_sample}")
    return run


def test_server_matches_its_openapi_document(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'openapi.db'}"
    auth = bearer(make_keys(db_url, "alice")["alice"])
    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS, require_auth=True,
                          max_tokens_per_turn=8, default_max_tokens=8, max_chains_per_tenant=None,
                          max_body_size=256 * 1024)
    app = create_app(config)
    settings = schemathesis.Config.from_dict({
        "seed": 1, "headers": auth, "base-url": "http://127.0.0.1", "workers": 1,
        "request-timeout": 120,  # a turn on a loaded 2-core machine can take longer than the 10 s default
        "cache": {"enabled": False},
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "checks": {"positive_data_acceptance": {"enabled": False}, "allow_header_conformance": {"enabled": False}},
        "phases": {"stateful": {"max-steps": 20}},
        "operations": [{"include-path-regex": r"^/v1/responses/\{response_id\}",
                        "checks": {"ensure_resource_availability": {"enabled": False}}}],  # store: false
    })
    try:  # schemathesis runs the app's lifespan (the engine worker, the database) and ends it here
        schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app, config=settings, headers=auth)
        run = _run(schema)
    finally:
        schemathesis_asgi.shutdown_lifespans()

    assert not run.errors, "\n".join(run.errors)
    assert not run.failures, "\n\n".join(run.failures[:10])
    assert not [k for k in run.statuses if k[1] >= 500]
    assert run.requests > 1000, run.requests
    for name in ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                 "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
                 "ignored_auth", "unsupported_method", "use_after_free", "ensure_resource_availability"):
        assert run.checks[name] > 0, (name, run.checks)
    # the requests reached the server's work, not only its refusals
    for operation, status, media_type in [
            ("POST /v1/chains", 201, "application/json"),
            ("POST /v1/chains/{chain_id}/turns", 200, "application/json"),
            ("POST /v1/chains/{chain_id}/turns", 200, "text/event-stream"),
            ("POST /v1/chains/{chain_id}/prune", 200, "application/json"),
            ("POST /v1/chains/{chain_id}/fork", 201, "application/json"),
            ("POST /v1/chains/{chain_id}/rewind", 200, "application/json"),
            ("POST /v1/chat/completions", 200, "application/json"),
            ("POST /v1/chat/completions", 200, "text/event-stream"),
            ("GET /v1/chains/{chain_id}", 200, "application/json"),
            ("DELETE /v1/chains/{chain_id}", 204, ""),
            ("POST /v1/chains", 401, "application/json"),
            ("POST /v1/chains", 415, "application/json"),
            ("POST /v1/chat/completions", 400, "application/json"),
            ("POST /v1/completions", 200, "application/json"),
            ("POST /v1/completions", 200, "text/event-stream"),
            ("POST /v1/completions", 400, "application/json"),
            ("POST /v1/responses", 200, "application/json"),
            ("POST /v1/responses", 200, "text/event-stream"),
            ("POST /v1/responses", 400, "application/json"),
            ("GET /v1/responses/{response_id}", 404, "application/json"),
            ("POST /v1/conversations", 200, "application/json"),
            ("POST /v1/conversations/{conversation_id}", 200, "application/json"),
            ("GET /v1/conversations/{conversation_id}/items", 200, "application/json"),
            ("POST /v1/conversations/{conversation_id}/items", 200, "application/json"),
            ("DELETE /v1/conversations/{conversation_id}", 200, "application/json"),
            ("POST /v1/messages", 200, "application/json"),
            ("POST /v1/messages", 200, "text/event-stream"),
            ("POST /v1/messages", 400, "application/json"),
            ("POST /v1/messages", 401, "application/json"),
            ("POST /v1/messages/count_tokens", 200, "application/json")]:
        assert run.answered(operation, status, media_type), (operation, status, media_type, run.statuses)
    # a missing chain's 404 on a chain route: which route meets one first depends on the stateful phase's path,
    # which follows the answers (a busy chain's 409, a slow turn), so it differs between a loaded and an idle machine
    chain_routes = ("turns", "prune", "fork", "rewind", "hints")
    assert any(run.answered(f"POST /v1/chains/{{chain_id}}/{route}", 404) for route in chain_routes), run.statuses
    print(f"schemathesis: {run.requests} requests, statuses "
          f"{dict(sorted(collections.Counter(k[1] for k in run.statuses.elements()).items()))}, "
          f"checks {dict(run.checks)}")
