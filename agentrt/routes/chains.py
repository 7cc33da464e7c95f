"""Chains and their turns under /v1/chains."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Annotated

from litestar import Controller, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter
from litestar.response import ServerSentEventMessage

from agentrt.chains import ChainService
from agentrt.disconnect import unless_disconnected
from agentrt.routes.event_stream import EventStream
from agentrt.turns import PendingTurn
from sdk.schema import ChainCreate, ChainList, ChainRead, ErrorBody, TurnCreate, TurnDelta, TurnResult, encode

Service = NamedDependency[ChainService]


class ChainController(Controller):
    path = "/v1/chains"

    @post("/")
    async def create_chain(self, data: JSONBody[ChainCreate], chains: Service) -> ChainRead:
        return await chains.create(data)

    @get("/")
    async def list_chains(self, chains: Service, offset: Annotated[int, QueryParameter(ge=0)] = 0,
                          limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20) -> ChainList:
        return await chains.page(offset, limit)

    @get("/{chain_id:str}")
    async def get_chain(self, chain_id: FromPath[str], chains: Service,
                        include_tokens: FromQuery[bool] = False) -> ChainRead:
        return await chains.read(chain_id, include_tokens)

    @delete("/{chain_id:str}")
    async def delete_chain(self, chain_id: FromPath[str], chains: Service) -> None:
        await chains.delete(chain_id)

    @post("/{chain_id:str}/turns", status_code=200)
    async def create_turn(self, chain_id: FromPath[str], data: JSONBody[TurnCreate], request: Request,
                          chains: Service) -> TurnResult | Response:
        turn = await chains.start_turn(chain_id, data)
        if data.stream:
            return EventStream(_sse(turn), background=BackgroundTask(turn.close))
        return await unless_disconnected(request, turn.result())


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
