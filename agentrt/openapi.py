"""The published OpenAPI document (``/schema/openapi.json``, also as YAML): Litestar's, completed from the same types.

Litestar builds the paths, operations and parameters from the route signatures. Its schema generator for msgspec
types does not describe what msgspec enforces: it drops ``forbid_unknown_fields`` (``additionalProperties:
false``), the constraints of list items and of optional values (``seed >= 0``), and the discriminators of tagged
unions. So every request and response body is described by msgspec's own JSON Schema of the handler's own types
(``msgspec.json.schema_components``): the schema the strict decoder validates against
(``agentrt.request_guards``). Nothing here is a hand-written copy of a type.

Completed per operation, from the handler and the app's configuration:

- statuses: those the route declares (``responses=chain_errors(...)`` / ``openai_errors(...)``), and those the
  app-wide machinery answers on any route: the auth guard's 401 (every route but the public ones; a keyless
  server still refuses an invalid ``art_`` key), the body's 413 (``max_body_size``) and 415 (not JSON) on routes
  with a body, the ``Host`` guard's 400 when it is on; each with its route family's error body (``ErrorBody``, or
  OpenAI's ``ErrorResponse`` where the OpenAI exception handlers answer);
- ``text/event-stream`` for the routes that stream (``opt={EVENT_STREAM: ...}``), one schema per event;
- the bearer API key: required on guarded routes when auth is on, optional when it is off, none on public routes;
- links from a created chain (``opt={CREATES: "chain_id"}``) to every operation that takes its id;
- what the server's configuration and model fix and a type cannot carry: ``max_tokens`` at most
  ``max_tokens_per_turn``, forced token ids below the vocabulary size, the served model's name.
"""

from __future__ import annotations

import copy
import importlib.metadata
import types
import typing
from collections.abc import Iterator, Mapping
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Litestar, Request
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, YamlRenderPlugin
from litestar.response.base import ASGIResponse, Response
from litestar.routes import HTTPRoute

from agentrt.config import ServerConfig
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS
from agentrt.openai_types import ErrorResponse
from sdk.schema import ErrorBody

# handler opt: the events of the route's ``text/event-stream`` answer, ``{event name: (data, ...)}``; each data
# alternative a type (JSON text of it) or a string (that text exactly); the name ``message`` is an event
# without an ``event:`` line
EVENT_STREAM = "agentrt.event_stream"
# handler opt: the path parameter that the ``id`` of the route's success body fills (a created resource): its
# response links to every operation that takes that parameter, so clients and testing tools can follow them
CREATES = "agentrt.creates"
SECURITY_SCHEME = "bearerApiKey"
REF = "#/components/schemas/{name}"
JSON = "application/json"

_STATUS_TEXT = {
    400: "Bad request: malformed JSON, a wrong type, an unknown or missing field, an out-of-range value; the error "
         "names the field",
    401: "No, a malformed, an unknown or a revoked API key (checked before the body is read); "
         "`WWW-Authenticate: Bearer`",
    404: "No such chain, or another tenant's (the same answer)",
    409: "The chain has a turn in flight",
    413: "The body is over the server's `max_body_size`, or the messages are longer than the model's context holds",
    415: "The body is not JSON: `Content-Type: application/json` (or `application/*+json`) is required",
    422: "The engine refuses the request (a prompt longer than the model's context or the KV pool), or the chat "
         "template cannot render the messages",
    429: "Over a per-tenant limit: chains (`max_chains_per_tenant`) or distinct method configurations "
         "(`max_method_configs_per_tenant`)",
    503: "The engine is overloaded; retry after `Retry-After` seconds",
}
_HOST_TEXT = "A `Host` this keyless server does not answer to (it answers only to loopback names)"
_KEYLESS_401 = ("An unknown or revoked `art_` API key (a request without one is the tenant `local` on this "
                "loopback server); `WWW-Authenticate: Bearer`")
_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer realm=\"agentrt\"`", "required": True,
                               "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}},
}


def _errors(body: type, statuses: tuple[int, ...], descriptions: Mapping[int, str]) -> dict[int, ResponseSpec]:
    return {s: ResponseSpec(data_container=body, generate_examples=False,
                            description=descriptions.get(s) or _STATUS_TEXT.get(s) or HTTPStatus(s).phrase)
            for s in statuses}


def chain_errors(*statuses: int, descriptions: Mapping[int, str] | None = None) -> dict[int, ResponseSpec]:
    """The error responses a chain route itself answers (``ErrorBody``), for the decorator's ``responses=``."""
    return _errors(ErrorBody, statuses, descriptions or {})


def openai_errors(*statuses: int, descriptions: Mapping[int, str] | None = None) -> dict[int, ResponseSpec]:
    """The error responses an OpenAI-compatible route itself answers (OpenAI's error object)."""
    return _errors(ErrorResponse, statuses, descriptions or {})


# --- the document ------------------------------------------------------------------------------------------
def _alternatives(annotation: Any) -> list[Any]:
    """The body types of a return annotation: the members of a union, less None and the Response classes
    (another representation: a stream)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return [a for a in (typing.get_args(annotation) if union else (annotation,))
            if a is not type(None) and not _is_response(a)]


def _is_response(tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    return isinstance(origin, type) and issubclass(origin, (Response, ASGIResponse))


def _operations(app: Litestar) -> Iterator[tuple[str, str, HTTPRouteHandler]]:
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            if not handler.resolve_include_in_schema():
                continue
            for method in handler.http_methods:
                yield route.path_format or "/", method.lower(), handler


class _Schemas:
    """msgspec's JSON Schema of every type the document names, generated together so that a type shared by
    several operations is one component (types of the same name in two modules are named by module)."""

    def __init__(self) -> None:
        self.types: list[Any] = []

    def ref(self, tp: Any) -> dict[str, Any]:
        """A placeholder for ``tp``'s schema, replaced by ``_fill`` once every type is known."""
        self.types.append(tp)
        return {_PLACEHOLDER: len(self.types) - 1}

    def generate(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return msgspec.json.schema_components(self.types, ref_template=REF)


_PLACEHOLDER = "x-agentrt-type"


def _fill(node: Any, schemas: list[dict[str, Any]]) -> Any:
    if isinstance(node, dict):
        if set(node) == {_PLACEHOLDER}:
            return schemas[node[_PLACEHOLDER]]
        return {k: _fill(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, schemas) for v in node]
    return node


def _any_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[0] if len(items) == 1 else {"anyOf": items}


def _event_schema(events: Mapping[str, tuple[Any, ...]], schemas: _Schemas) -> dict[str, Any]:
    """One event of the stream, as tools read an event (``{"event", "data", "id", "retry"}``; OpenAPI 3.2's
    ``itemSchema`` for text/event-stream): ``data`` is JSON text of the given types, or a literal."""
    alternatives = []
    for name, data in events.items():
        literals = [d for d in data if isinstance(d, str)]
        json_data = {"type": "string", "contentMediaType": JSON,
                     "contentSchema": _any_of([schemas.ref(d) for d in data if not isinstance(d, str)])}
        data_schema = json_data if not literals else {
            "if": {"enum": literals}, "then": {"type": "string"}, "else": json_data}
        event = {"type": "object", "properties": {"event": {"const": name}, "data": data_schema},
                 "required": ["event", "data"] if name != "message" else ["data"]}
        alternatives.append(event)
    return _any_of(alternatives)


class OpenAPIDocument:
    """Completes Litestar's generated document for ``app`` and the server ``config`` (built once, on the first
    request for it)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._document: dict[str, Any] | None = None

    def __call__(self, app: Litestar, generated: dict[str, Any]) -> dict[str, Any]:
        if self._document is None:
            self._document = self.complete(app, generated)
        return self._document

    def complete(self, app: Litestar, generated: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(generated)
        schemas = _Schemas()
        guarded = False
        for path, method, handler in _operations(app):
            operation = doc.get("paths", {}).get(path, {}).get(method)
            if operation is None:
                continue
            public = bool(handler.opt.get("public"))
            guarded |= not public
            self._operation(operation, handler, public, schemas)
        self._links(doc, app)
        built, components = schemas.generate()
        doc["paths"] = _fill(doc.get("paths", {}), built)
        worker = app.state.get("worker")
        self._limits(components, worker.engine.model_config.vocab_size if worker is not None else None)
        if (model := app.state.get("model_name")) is not None:
            _served_model(doc, components, model)
        doc["components"] = {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {SECURITY_SCHEME: {
                "type": "http", "scheme": "bearer", "bearerFormat": "art_<key_id>_<secret>",
                "description": "An API key from `agentrt keys create --tenant NAME`: "
                               "`Authorization: Bearer art_<key_id>_<secret>`. It selects the tenant. "
                               + ("Required." if self.config.auth_required else
                                  "Optional on this loopback server: without one the tenant is `local`; "
                                  "an `art_` key is still checked.")}},
        }
        if guarded:
            doc["security"] = [{SECURITY_SCHEME: []}] if self.config.auth_required else [{SECURITY_SCHEME: []}, {}]
        return doc

    def _operation(self, operation: dict[str, Any], handler: HTTPRouteHandler, public: bool,
                   schemas: _Schemas) -> None:
        signature = handler.parsed_fn_signature
        openai = handler.resolve_exception_handlers().get(HTTPException) is OPENAI_EXCEPTION_HANDLERS[HTTPException]
        error_body = ErrorResponse if openai else ErrorBody
        responses: dict[str, Any] = operation.setdefault("responses", {})

        data = signature.parameters.get("data")
        if data is not None:
            operation["requestBody"] = {"required": not data.is_optional,
                                        "content": {JSON: {"schema": schemas.ref(data.annotation)}}}

        success = responses.get(str(handler.status_code), {})
        bodies = _alternatives(signature.return_type.annotation)
        if JSON in success.get("content", {}) and bodies:
            success["content"][JSON]["schema"] = _any_of([schemas.ref(t) for t in bodies])
        if (events := handler.opt.get(EVENT_STREAM)) is not None:
            success.setdefault("content", {})["text/event-stream"] = {"schema": _event_schema(events, schemas)}
            success["description"] = ("The result as JSON; with `stream: true`, server-sent events "
                                      "(`text/event-stream`; the schema describes one event)")

        declared = dict(handler.responses or {})
        # Litestar's own (a 400 where parameters are validated) stay, with the family's body
        statuses = set(declared) | {int(s) for s in responses if s.isdigit() and int(s) >= 400}
        validated = 400 in statuses or data is not None
        if self.config.host_allow_list is not None or data is not None:
            statuses.add(400)
        if not public:
            statuses.add(401)
        if data is not None:
            statuses |= {413, 415}
        for status in sorted(statuses):
            spec = declared.get(status)
            description = spec.description if spec is not None else _STATUS_TEXT.get(status, HTTPStatus(status).phrase)
            if status == 400:
                host = self.config.host_allow_list is not None
                description = "; or ".join(([description] if validated else []) + ([_HOST_TEXT] if host else []))
            if status == 401 and not self.config.auth_required:
                description = _KEYLESS_401
            body = spec.data_container if spec is not None and spec.data_container is not None else error_body
            response: dict[str, Any] = {"description": description,
                                        "content": {JSON: {"schema": schemas.ref(body)}}}
            if status in _HEADERS:
                response["headers"] = _HEADERS[status]
            responses[str(status)] = response
        operation["responses"] = dict(sorted(responses.items()))
        if public:
            operation["security"] = []

    @staticmethod
    def _links(doc: dict[str, Any], app: Litestar) -> None:
        takes: dict[str, list[str]] = {}  # path parameter -> operation ids
        for path, method, _ in _operations(app):
            operation = doc.get("paths", {}).get(path, {}).get(method, {})
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and "operationId" in operation:
                    takes.setdefault(parameter["name"], []).append(operation["operationId"])
        for path, method, handler in _operations(app):
            if (name := handler.opt.get(CREATES)) is None:
                continue
            success = doc["paths"][path][method]["responses"][str(handler.status_code)]
            success["links"] = {target: {"operationId": target, "parameters": {name: "$response.body#/id"}}
                                for target in sorted(takes.get(name, []))}

    def _limits(self, components: dict[str, Any], vocab_size: int | None) -> None:
        """The server's limits on values that the types leave open (a value past one is a 400 naming it):
        ``max_tokens_per_turn``, and forced token ids below the model's vocabulary size."""
        limits: list[tuple[str, str, int]] = [(name, field, self.config.max_tokens_per_turn) for name, field in (
            ("Sampling", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
            ("ChatCompletionRequest", "max_completion_tokens"))]
        if vocab_size is not None:
            limits += [("Sampling", "forced_token_ids", vocab_size - 1),
                       ("ChatCompletionRequest", "forced_token_ids", vocab_size - 1)]
        for name, field, limit in limits:
            schema = components.get(name, {}).get("properties", {}).get(field)
            for branch in schema.get("anyOf", [schema]) if schema is not None else []:
                target = branch.get("items", {}) if branch.get("type") == "array" else branch
                if target.get("type") == "integer":
                    target["maximum"] = min(limit, target.get("maximum", limit))


def _served_model(doc: dict[str, Any], components: dict[str, Any], model: str) -> None:
    """The served model's name: the one value a chain's ``model`` takes (another is a 400), an example of the
    OpenAI routes' (another is a 404, as OpenAI answers an unknown model)."""
    chain_model = components.get("ChainCreate", {}).get("properties", {}).get("model")
    if chain_model is not None:
        for branch in chain_model.get("anyOf", [chain_model]):
            if branch.get("type") == "string":
                branch["enum"] = [model]
    completion_model = components.get("ChatCompletionRequest", {}).get("properties", {}).get("model")
    if completion_model is not None:
        completion_model["examples"] = [model]
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                if parameter.get("in") == "path" and parameter.get("name") == "model_id":
                    parameter.setdefault("schema", {})["examples"] = [model]


class _Completed:
    def __init__(self, document: OpenAPIDocument, **kwargs: Any):
        super().__init__(**kwargs)
        self.document = document

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return super().render(request, self.document(request.app, openapi_schema))  # type: ignore[misc]


class _Json(_Completed, JsonRenderPlugin):
    pass


class _Yaml(_Completed, YamlRenderPlugin):
    pass


def openapi_config(config: ServerConfig) -> OpenAPIConfig:
    """``/schema/openapi.json`` (also at ``/schema``) and ``/schema/openapi.yaml``: the completed document."""
    document = OpenAPIDocument(config)
    try:
        version = importlib.metadata.version("agentrt")
    except importlib.metadata.PackageNotFoundError:
        version = "0.0.0"
    return OpenAPIConfig(
        title="agentrt",
        version=version,
        description=("Agent sessions on an LLM engine: chains (a conversation whose KV the engine keeps between "
                     "turns), their turns (JSON or server-sent events), pruning, fork and rewind; and "
                     "OpenAI-compatible chat completions and models. Chain routes answer errors as "
                     "`{status_code, detail, extra}`, the OpenAI-compatible routes as OpenAI's "
                     "`{error: {message, type, param, code}}`. Bodies are decoded strictly: an integer is "
                     "written as one (`8`, not `8.0`, `8e0` or `\"8\"`), a boolean as `true` / `false`. "
                     "The WebSocket `/v1/chains/{chain_id}/ws` is described in docs/server.md."),
        render_plugins=[_Json(document, path=["/openapi.json", "/"]), _Yaml(document)],
    )
