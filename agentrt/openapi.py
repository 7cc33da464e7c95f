"""The published OpenAPI document (``/schema/openapi.json``, also as YAML): Litestar's, completed from the same types.

Litestar builds the paths, operations and parameters from the route signatures. Its schema generator for msgspec
types does not describe what msgspec enforces: it drops ``forbid_unknown_fields`` (``additionalProperties:
false``), the constraints of list items and of optional values (``seed >= 0``), and the discriminators of tagged
unions. So every request and response body is described by msgspec's own JSON Schema of the handler's own types
(``msgspec.json.schema_components``): the schema the strict decoder validates against
(``agentrt.request_guards``). Nothing here is a hand-written copy of a type.

Completed per operation, from the handler and the app's configuration:

- statuses: those the route declares (``responses=chain_errors(...)`` / ``openai_errors(...)`` /
  ``anthropic_errors(...)``), and those the app-wide machinery answers on any route: the auth guard's 401 (every
  route but the public ones; a keyless server still refuses an invalid ``art_`` key), the body's 413
  (``max_body_size``) and 415 (not JSON) on routes with a body, the ``Host`` guard's 400 when it is on; each with
  its route family's error body (``ErrorBody``; OpenAI's ``ErrorResponse`` where the OpenAI exception handlers
  answer, Anthropic's where the Anthropic ones do);
- ``text/event-stream`` for the routes that stream (``opt={EVENT_STREAM: ...}``), one schema per event;
- the bearer API key: required on guarded routes when auth is on, optional when it is off, none on public routes;
  routes that check the key themselves (``opt={API_KEY_HEADER: "x-api-key"}``: Anthropic's) take it in that header
  too;
- links from a created resource (``opt={CREATES: "chain_id"}``: a chain; a response) to every operation that
  takes its id;
- example request bodies (``opt={REQUEST_EXAMPLES: {...}}``), with the served model's name;
- a tagged struct referenced as a field's only type, inlined with its tag optional (as msgspec decodes it);
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

from agentrt.anthropic_errors import ANTHROPIC_EXCEPTION_HANDLERS
from agentrt.anthropic_types import ErrorResponse as AnthropicErrorResponse
from agentrt.config import ServerConfig
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS
from agentrt.openai_types import ErrorResponse
from sdk.schema import ErrorBody

# handler opt: the events of the route's ``text/event-stream`` answer, ``{event name: (data, ...)}``; each data
# alternative a type (JSON text of it) or a string (that text exactly); the name ``message`` is an event
# without an ``event:`` line, a name starting with ``^`` a regular expression of the names
EVENT_STREAM = "agentrt.event_stream"
# handler opt: the path parameter that the ``id`` of the route's success body fills (a created resource): its
# response links to every operation that takes that parameter, so clients and testing tools can follow them
CREATES = "agentrt.creates"
# handler opt: the route is public to the app-wide guard and checks the API key itself, from ``Authorization:
# Bearer`` or from this header (the Anthropic routes: ``x-api-key``)
API_KEY_HEADER = "agentrt.api_key_header"
# handler opt: example request bodies, ``{name: body}`` (a ``model`` field is set to the served model's name), in
# the document as the body's ``examples``: what a client sends, and what testing tools send first
REQUEST_EXAMPLES = "agentrt.request_examples"
SECURITY_SCHEME = "bearerApiKey"
HEADER_SECURITY_SCHEME = "headerApiKey"
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


def anthropic_errors(*statuses: int, descriptions: Mapping[int, str] | None = None) -> dict[int, ResponseSpec]:
    """The error responses an Anthropic Messages route itself answers (Anthropic's error object)."""
    return _errors(AnthropicErrorResponse, statuses, descriptions or {})


# the error body of a route family, by the handler its exception handlers answer an HTTPException with
_ERROR_BODIES: dict[Any, type] = {OPENAI_EXCEPTION_HANDLERS[HTTPException]: ErrorResponse,
                                  ANTHROPIC_EXCEPTION_HANDLERS[HTTPException]: AnthropicErrorResponse}


# --- the document ------------------------------------------------------------------------------------------
def _alternatives(annotation: Any) -> list[Any]:
    """The body types of a return annotation: the members of a union, less None and the bare Response classes
    (another representation: a stream); ``Response[T]`` is a body of ``T``."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    out = []
    for a in typing.get_args(annotation) if union else (annotation,):
        if _is_response(a):
            out += [t for t in typing.get_args(a) if t is not type(None)]
        elif a is not type(None):
            out.append(a)
    return out


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


def _tagged_structs(types: list[Any]) -> dict[type, str]:
    """The tagged Struct types reachable from ``types``, with their tag field."""
    found: dict[type, str] = {}
    seen: set[int] = set()

    def walk(t: Any) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        if isinstance(t, msgspec.inspect.StructType):
            if t.tag_field is not None:
                found[t.cls] = t.tag_field
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, msgspec.inspect.Metadata):
            walk(t.type)
        elif isinstance(t, msgspec.inspect.CollectionType):
            walk(t.item_type)
        elif isinstance(t, msgspec.inspect.DictType):
            walk(t.value_type)
        elif isinstance(t, msgspec.inspect.UnionType):
            for member in t.types:
                walk(member)

    for info in msgspec.inspect.multi_type_info(types):
        walk(info)
    return found


def _lone_tags(types: list[Any], components: dict[str, Any], doc: dict[str, Any]) -> None:
    """A tagged Struct outside a union of several (a field of that one type) is decoded by msgspec with its tag
    field optional (a wrong value is still refused), while msgspec's schema requires it everywhere: where such a
    struct is referenced alone, its schema is inlined with the tag not required, as the decoder reads it.
    References inside a tagged union (an ``anyOf`` with a ``discriminator``) keep the tag required."""
    tagged = {}
    for cls, tag in _tagged_structs(types).items():
        # msgspec's component name: the class name, or its import path where two classes share the name
        name = cls.__name__ if cls.__name__ in components else f"{cls.__module__}.{cls.__qualname__}"
        if components.get(name, {}).get("title") == cls.__name__:
            tagged[REF.format(name=name)] = (name, tag)

    def relax(node: Any, inlining: frozenset[str] = frozenset()) -> Any:
        if isinstance(node, list):
            return [relax(v, inlining) for v in node]
        if not isinstance(node, dict) or "discriminator" in node:
            return node
        if set(node) == {"$ref"} and node["$ref"] in tagged and node["$ref"] not in inlining:
            name, tag = tagged[node["$ref"]]
            schema = relax(components[name], inlining | {node["$ref"]})
            return {**schema, "required": [r for r in schema.get("required", []) if r != tag]}
        return {k: relax(v, inlining) for k, v in node.items()}

    original = dict(components)
    for name, schema in original.items():
        if "properties" in schema:
            components[name] = {**schema, "properties": relax(schema["properties"])}
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and "requestBody" in operation:
                operation["requestBody"] = relax(operation["requestBody"])


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
        named = {"type": "string", "pattern": name} if name.startswith("^") else {"const": name}
        event = {"type": "object", "properties": {"event": named, "data": data_schema},
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
            public = bool(handler.opt.get("public")) and handler.opt.get(API_KEY_HEADER) is None
            guarded |= not public
            self._operation(operation, handler, public, schemas)
        self._links(doc, app)
        built, components = schemas.generate()
        doc["paths"] = _fill(doc.get("paths", {}), built)
        _lone_tags(schemas.types, components, doc)
        worker = app.state.get("worker")
        self._limits(components, worker.engine.model_config.vocab_size if worker is not None else None)
        if (model := app.state.get("model_name")) is not None:
            _served_model(doc, components, model)
        required = ("Required." if self.config.auth_required else
                    "Optional on this loopback server: without one the tenant is `local`; an `art_` key is still "
                    "checked.")
        security_schemes: dict[str, Any] = {SECURITY_SCHEME: {
            "type": "http", "scheme": "bearer", "bearerFormat": "art_<key_id>_<secret>",
            "description": "An API key from `agentrt keys create --tenant NAME`: "
                           "`Authorization: Bearer art_<key_id>_<secret>`. It selects the tenant. " + required}}
        headers = {h.opt[API_KEY_HEADER] for _, _, h in _operations(app) if h.opt.get(API_KEY_HEADER)}
        for header in sorted(headers):
            security_schemes[HEADER_SECURITY_SCHEME] = {
                "type": "apiKey", "in": "header", "name": header,
                "description": f"The same API key in `{header}` (as Anthropic's clients send it), on the routes "
                               f"that name this scheme; `Authorization: Bearer` works there too. " + required}
        doc["components"] = {"schemas": dict(sorted(components.items())), "securitySchemes": security_schemes}
        if guarded:
            doc["security"] = [{SECURITY_SCHEME: []}] if self.config.auth_required else [{SECURITY_SCHEME: []}, {}]
        return doc

    def _operation(self, operation: dict[str, Any], handler: HTTPRouteHandler, public: bool,
                   schemas: _Schemas) -> None:
        signature = handler.parsed_fn_signature
        error_body = _ERROR_BODIES.get(handler.resolve_exception_handlers().get(HTTPException), ErrorBody)
        responses: dict[str, Any] = operation.setdefault("responses", {})

        data = signature.parameters.get("data")
        if data is not None:
            operation["requestBody"] = {"required": not data.is_optional,
                                        "content": {JSON: {"schema": schemas.ref(data.annotation)}}}
            if examples := handler.opt.get(REQUEST_EXAMPLES):
                operation["requestBody"]["content"][JSON]["examples"] = {
                    name: {"value": copy.deepcopy(body)} for name, body in examples.items()}

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
        elif handler.opt.get(API_KEY_HEADER):
            operation["security"] = [{SECURITY_SCHEME: []}, {HEADER_SECURITY_SCHEME: []}] + \
                ([] if self.config.auth_required else [{}])

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
        """The server's limits on values that the types leave open: forced token ids below the model's
        vocabulary size (a value past it is a 400 naming it), and ``max_tokens_per_turn``, described on the
        fields it bounds: the foreign APIs lower a larger value to it (no schema maximum there), a chain turn
        refuses one unless ``sampling.fit_max_tokens``."""
        limit = self.config.max_tokens_per_turn
        for name, field in (("Sampling", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                            ("ChatCompletionRequest", "max_completion_tokens"), ("TextCompletionRequest", "max_tokens"),
                            ("ResponsesRequest", "max_output_tokens"), ("MessagesRequest", "max_tokens")):
            schema = components.get(name, {}).get("properties", {}).get(field)
            if schema is not None:
                how = ("a larger value is a 400 unless fit_max_tokens" if name == "Sampling"
                       else "a larger value is lowered to it")
                schema["description"] = (f"at most {limit} tokens per turn here ({how}); generation also ends "
                                         "where the model's context or the KV pool runs out")
        # the chain route's rule stands as the schema's maximum (fit_max_tokens lifts it, as the description says)
        limits: list[tuple[str, str, int]] = [("Sampling", "max_tokens", limit)]
        if vocab_size is not None:
            limits += [(name, field, vocab_size - 1) for name, field in (
                ("Sampling", "forced_token_ids"), ("ChatCompletionRequest", "forced_token_ids"),
                ("TextCompletionRequest", "forced_token_ids"), ("TextCompletionRequest", "prompt"),
                ("MessagesRequest", "agentrt_forced_token_ids"))]
        for name, field, limit in limits:
            schema = components.get(name, {}).get("properties", {}).get(field)
            if schema is not None:
                _cap_integers(schema, limit)


def _cap_integers(schema: dict[str, Any], limit: int) -> None:
    """``maximum: limit`` on the integers of ``schema``: itself, its union's branches, its items (nested lists
    of token ids: a text completion's ``prompt``)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "array":
            _cap_integers(branch.get("items", {}), limit)
        elif branch.get("type") == "integer":
            branch["maximum"] = min(limit, branch.get("maximum", limit))


def _served_model(doc: dict[str, Any], components: dict[str, Any], model: str) -> None:
    """The served model's name: the one value a chain's ``model`` takes (another is a 400), an example of the
    OpenAI routes' (another is a 404, as OpenAI answers an unknown model)."""
    chain_model = components.get("ChainCreate", {}).get("properties", {}).get("model")
    if chain_model is not None:
        for branch in chain_model.get("anyOf", [chain_model]):
            if branch.get("type") == "string":
                branch["enum"] = [model]
    for request in ("ChatCompletionRequest", "TextCompletionRequest", "ResponsesRequest", "MessagesRequest",
                    "CountTokensRequest"):
        completion_model = components.get(request, {}).get("properties", {}).get("model")
        if completion_model is not None:
            completion_model["examples"] = [model]
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                if parameter.get("in") == "path" and parameter.get("name") == "model_id":
                    parameter.setdefault("schema", {})["examples"] = [model]
            body = operation.get("requestBody", {}) if isinstance(operation, dict) else {}
            for example in body.get("content", {}).get(JSON, {}).get("examples", {}).values():
                if "model" in example.get("value", {}):
                    example["value"]["model"] = model


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
                     "turns), their turns (JSON or server-sent events), pruning, fork and rewind; "
                     "OpenAI-compatible chat completions, text completions, responses and models; Anthropic's "
                     "Messages API. Chain routes answer errors as `{status_code, detail, extra}`, the "
                     "OpenAI-compatible routes as OpenAI's `{error: {message, type, param, code}}`, the Messages "
                     "routes as Anthropic's `{type: \"error\", error: {type, message}}`. Bodies are decoded "
                     "strictly: an integer is "
                     "written as one (`8`, not `8.0`, `8e0` or `\"8\"`), a boolean as `true` / `false`. "
                     "The WebSocket `/v1/chains/{chain_id}/ws` is described in docs/server.md."),
        render_plugins=[_Json(document, path=["/openapi.json", "/"]), _Yaml(document)],
    )
