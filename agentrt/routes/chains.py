"""Chains and their turns under /v1/chains."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Annotated

import msgspec
from litestar import Controller, Request, Response, WebSocket, delete, get, post, websocket
from litestar.exceptions import WebSocketDisconnect
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from litestar.response import ServerSentEventMessage

from agentrt.chains import ChainService
from agentrt.disconnect import unless_disconnected
from agentrt.engine_worker import EngineUnavailable
from agentrt.errors import on_http_error
from agentrt.openapi import CREATES, EVENT_STREAM, chain_errors
from agentrt.routes.event_stream import EventStream
from agentrt.turns import PendingTurn
from engine.chain_index import ChainBusyError, UnknownChainError
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from sdk.schema import (ChainCreate, ChainList, ChainRead, ErrorBody, ErrorDetail, ForkRequest, HintsRequest,
                        PruneRequest, PruneResult, RewindRequest, TurnCreate, TurnDelta, TurnResult, encode)

Service = NamedDependency[ChainService]
Tenant = NamedDependency[str]  # the request's tenant (agentrt.auth.auth_guard)
# every SQL database takes an offset or limit this large (PostgreSQL's OFFSET is a BIGINT, SQLite's an int64);
# a tenant holds at most max_chains_per_tenant chains anyway
MAX_OFFSET = 2**31 - 1
_NAMED_FIELD = re.compile(r"(?:unknown|required) field `([^`]+)`")
# a streamed turn (``stream: true``): deltas, then the result, or an error once the stream has started
TURN_EVENTS = {"delta": (TurnDelta,), "done": (TurnResult,), "error": (ErrorBody,)}


class ChainController(Controller):
    path = "/v1/chains"

    @post("/", responses=chain_errors(422, 429), opt={CREATES: "chain_id"})
    async def create_chain(self, data: JSONBody[ChainCreate], chains: Service, tenant: Tenant) -> ChainRead:
        return await chains.create(data, tenant=tenant)

    @get("/")
    async def list_chains(self, chains: Service, tenant: Tenant,
                          offset: Annotated[int, QueryParameter(ge=0, le=MAX_OFFSET)] = 0,
                          limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20) -> ChainList:
        return await chains.page(offset, limit, tenant=tenant)

    @get("/{chain_id:str}", responses=chain_errors(404))
    async def get_chain(self, chain_id: FromPath[str], chains: Service, tenant: Tenant,
                        include_tokens: FromQuery[bool] = False) -> ChainRead:
        return await chains.read(chain_id, include_tokens, tenant=tenant)

    @delete("/{chain_id:str}", responses=chain_errors(404, 409))
    async def delete_chain(self, chain_id: FromPath[str], chains: Service, tenant: Tenant) -> None:
        await chains.delete(chain_id, tenant=tenant)

    @post("/{chain_id:str}/turns", status_code=200, opt={EVENT_STREAM: TURN_EVENTS},
          responses=chain_errors(404, 409, 422, 503))
    async def create_turn(self, chain_id: FromPath[str], data: JSONBody[TurnCreate], request: Request,
                          chains: Service, tenant: Tenant) -> TurnResult | Response:
        turn = await chains.start_turn(chain_id, data, tenant=tenant)
        if data.stream:
            return EventStream(_sse(turn), background=BackgroundTask(turn.close))
        return await unless_disconnected(request, turn.result())

    @post("/{chain_id:str}/prune", status_code=200, responses=chain_errors(404, 409))
    async def prune_chain(self, chain_id: FromPath[str], data: JSONBody[PruneRequest], chains: Service,
                          tenant: Tenant) -> PruneResult:
        return await chains.prune(chain_id, data, tenant=tenant)

    @post("/{chain_id:str}/fork", status_code=201, responses=chain_errors(404, 409, 429), opt={CREATES: "chain_id"})
    async def fork_chain(self, chain_id: FromPath[str], chains: Service, tenant: Tenant,
                         data: JSONBody[ForkRequest | None] = None) -> ChainRead:
        return await chains.fork(chain_id, data or ForkRequest(), tenant=tenant)

    @post("/{chain_id:str}/hints", status_code=200, responses=chain_errors(404, 409))
    async def chain_hints(self, chain_id: FromPath[str], data: JSONBody[HintsRequest], chains: Service,
                          tenant: Tenant) -> ChainRead:
        """Session hints for the chain's KV: pin, priority, TTL, release now, prefetch now (docs/server.md)."""
        return await chains.hints(chain_id, data, tenant=tenant)

    @post("/{chain_id:str}/rewind", status_code=200, responses=chain_errors(404, 409))
    async def rewind_chain(self, chain_id: FromPath[str], data: JSONBody[RewindRequest], chains: Service,
                           tenant: Tenant) -> ChainRead:
        return await chains.rewind(chain_id, data, tenant=tenant)

    @websocket("/{chain_id:str}/ws")
    async def chain_ws(self, socket: WebSocket, chain_id: FromPath[str], chains: Service, tenant: Tenant) -> None:
        """Each text message is a turn request (the POST turns body); replies: delta*, turn_end, prune*, or error.
        Under uvicorn (``ws_max_size`` = ``max_body_size``) a frame over ``max_body_size`` closes the socket
        with 1009 before it is buffered whole; a server that hands such a message over gets a 413 error here."""
        await socket.accept()
        limit = chains.config.max_body_size
        try:
            while True:
                event = await socket.receive()
                if event["type"] == "websocket.disconnect":
                    return
                raw = event.get("text")
                if raw is None:
                    await _ws_error(socket, 400, "binary frames are not accepted: send each turn request as a "
                                                 "text frame of JSON")
                    continue
                size = len(raw.encode("utf-8", "surrogatepass"))
                if size > limit:  # as a body over it on the POST route (the whole message was read already)
                    await _ws_error(socket, 413, f"a message of {size} bytes is over the limit of {limit} bytes "
                                                 "(max_body_size)")
                    continue
                await _ws_turn(socket, chains, chain_id, raw, tenant)
        except WebSocketDisconnect:
            pass


async def _sse(turn: PendingTurn) -> AsyncGenerator[ServerSentEventMessage, None]:
    try:
        async with aclosing(turn.events()) as events:
            async for event in events:
                name = "delta" if isinstance(event, TurnDelta) else "done"
                yield ServerSentEventMessage(event=name, data=encode(event).decode())
    except HTTPException as exc:
        body = ErrorBody(status_code=exc.status_code, detail=exc.detail)
        yield ServerSentEventMessage(event="error", data=encode(body).decode())
    except Exception as exc:
        body = ErrorBody(status_code=500, detail=f"internal error: {type(exc).__name__}: {exc}")
        yield ServerSentEventMessage(event="error", data=encode(body).decode())


async def _ws_send(socket: WebSocket, kind: str, payload: object) -> None:
    body = msgspec.to_builtins(payload)
    await socket.send_data(encode({"type": kind, **body}).decode(), mode="text")


async def _ws_error(socket: WebSocket, status: int, detail: str, extra: list[ErrorDetail] | None = None) -> None:
    await _ws_send(socket, "error", ErrorBody(status_code=status, detail=detail, extra=extra))


def _ws_key(message: str) -> str | None:
    """The field a msgspec error names, dotted as the HTTP routes name it: ``sampling.max_tokens`` for
    "... - at `$.sampling.max_tokens`", ``messages[0].foo`` for "unknown field `foo` - at `$.messages[0]`"."""
    path = message.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") if " - at `$" in message else ""
    named = _NAMED_FIELD.search(message)
    if named is not None:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


async def _ws_turn(socket: WebSocket, chains: ChainService, chain_id: str, raw: str | bytes, tenant: str) -> None:
    try:
        data = msgspec.json.decode(raw, type=TurnCreate)
    except msgspec.ValidationError as exc:
        key = _ws_key(str(exc))
        await _ws_error(socket, 400, str(exc), [ErrorDetail(message=str(exc), key=key, source="body")])
        return
    except msgspec.DecodeError as exc:
        await _ws_error(socket, 400, f"malformed JSON: {exc}")
        return
    try:
        turn = await chains.start_turn(chain_id, data, tenant=tenant)
        async with aclosing(turn.events()) as events:
            async for event in events:
                if isinstance(event, TurnDelta):
                    await _ws_send(socket, "delta", event)
                else:
                    await _ws_send(socket, "turn_end", event)
                    for pruned in event.pruned:
                        await _ws_send(socket, "prune", pruned)
    except HTTPException as exc:
        response = on_http_error(None, exc)  # type: ignore[arg-type]
        body = response.content
        await _ws_error(socket, body.status_code, body.detail, body.extra)
    except EngineUnavailable as exc:
        await _ws_error(socket, 503, str(exc))
    except InvalidRequestError as exc:
        status = (409 if isinstance(exc, ChainBusyError) else 404 if isinstance(exc, UnknownChainError)
                  else 400 if isinstance(exc, InvalidSamplingParamsError) else 422)
        await _ws_error(socket, status, str(exc))
    except WebSocketDisconnect:
        raise
    except Exception as exc:
        await _ws_error(socket, 500, f"internal error: {type(exc).__name__}: {exc}")
