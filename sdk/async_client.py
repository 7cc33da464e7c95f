"""Asynchronous client, mirroring sdk.client: ``await AsyncClient(url).chains.create(...)`` returns an
``AsyncChain``; ``async for item in chain.stream(...)``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, TypeVar

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from sdk import _base
from sdk._base import MessageLike
from sdk.errors import AgentrtError, Overloaded
from sdk.schema import (ChainList, ChainRead, PrunePolicy, PruneResult, Sampling, Tool, TurnDelta, TurnResult,
                        encode)

T = TypeVar("T")


class AsyncClient:
    """``AsyncClient(base_url, api_key=None, timeout=120, max_retries=3)``: REST over httpx, streaming over WebSocket.

    A 503 is retried up to ``max_retries`` times, waiting the server's ``Retry-After`` (else ``backoff * 2**n``
    seconds), each wait capped at ``max_backoff``; then ``Overloaded`` is raised."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = _base.DEFAULT_TIMEOUT, max_retries: int = 3, *, backoff: float = 0.5,
                 max_backoff: float = 30.0, transport: httpx.AsyncBaseTransport | None = None,
                 headers: Mapping[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key, self.timeout, self.max_retries = api_key, timeout, max_retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self._headers = {**_base.auth_headers(api_key), **(headers or {})}
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport, headers=self._headers)
        self.chains = AsyncChains(self)

    async def request(self, method: str, path: str, *, json: Any = None, params: Mapping[str, Any] | None = None,
                type: type[T] | None = None) -> Any:
        """One REST call with the retry on 503; decodes the body into ``type`` (None: no body)."""
        content = encode(json) if json is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._http.request(method, path, content=content, params=params, headers=headers)
            except httpx.TransportError as exc:
                raise _base.connection_error(self.base_url, exc) from exc
            if response.status_code == 503 and attempt < self.max_retries:
                await asyncio.sleep(_base.retry_delay(attempt, response, self.backoff, self.max_backoff))
                continue
            if response.status_code >= 400:
                raise _base.error_from_response(response)
            return _base.decode(response, type) if type is not None else None
        raise Overloaded("unreachable")  # pragma: no cover

    async def health(self) -> Any:
        return await self.request("GET", "/health", type=dict)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncChains:
    def __init__(self, client: AsyncClient):
        self._client = client

    async def create(self, *, system_prompt: str | None = None, tools: Iterable[Tool | Mapping[str, Any]] | None = None,
               metadata: Mapping[str, Any] | None = None, prune_policy: PrunePolicy | Mapping[str, Any] | None = None,
               model: str | None = None, method: str | None = None,
               method_config: Mapping[str, Any] | None = None) -> AsyncChain:
        body = _base.create_body(system_prompt=system_prompt, tools=list(tools) if tools is not None else None,
                                 metadata=metadata, prune_policy=prune_policy, model=model, method=method,
                                 method_config=method_config)
        return AsyncChain(self._client, await self._client.request("POST", "/v1/chains", json=body, type=ChainRead))

    async def get(self, chain_id: str, include_tokens: bool = False) -> AsyncChain:
        return AsyncChain(self._client, await self._read(chain_id, include_tokens))

    async def list(self, offset: int = 0, limit: int = 20) -> ChainList:
        return await self._client.request("GET", "/v1/chains", params={"offset": offset, "limit": limit}, type=ChainList)

    async def _read(self, chain_id: str, include_tokens: bool) -> ChainRead:
        params = {"include_tokens": "true"} if include_tokens else None
        return await self._client.request("GET", f"/v1/chains/{chain_id}", params=params, type=ChainRead)


class AsyncChain:
    """A handle on one chain; ``info`` is the chain as last read (create, get, state, fork, rewind)."""

    def __init__(self, client: AsyncClient, info: ChainRead):
        self._client, self.info, self.id = client, info, info.id

    def __repr__(self) -> str:
        return f"AsyncChain({self.id!r})"

    async def send(self, messages: MessageLike | Iterable[MessageLike] | None = None, *,
             tool_results: Iterable[Any] | None = None, assistant_prefix: str | None = None,
             sampling: Sampling | Mapping[str, Any] | None = None, **sampling_overrides: Any) -> TurnResult:
        """One turn: ``send("hi", max_tokens=32)``, ``send(tool_results=[(call, {"temp": 18})])``."""
        body = _base.turn_body(messages, tool_results, assistant_prefix, sampling, sampling_overrides)
        return await self._client.request("POST", f"/v1/chains/{self.id}/turns", json=body, type=TurnResult)

    async def stream(self, messages: MessageLike | Iterable[MessageLike] | None = None, *,
               tool_results: Iterable[Any] | None = None, assistant_prefix: str | None = None,
               sampling: Sampling | Mapping[str, Any] | None = None,
               **sampling_overrides: Any) -> AsyncIterator[TurnDelta | TurnResult]:
        """One turn over the chain's WebSocket: yields TurnDelta objects, then the TurnResult. Closing the
        iterator early closes the socket, which aborts the turn."""
        body = _base.turn_body(messages, tool_results, assistant_prefix, sampling, sampling_overrides)
        url = _base.ws_url(self._client.base_url, self.id)
        decoder = _base.StreamDecoder()
        try:
            ws = await ws_connect(url, additional_headers=self._client._headers, open_timeout=self._client.timeout,
                                  max_size=None)
        except (OSError, TimeoutError) as exc:
            raise _base.connection_error(self._client.base_url, exc) from exc
        async with ws:
            try:
                await ws.send(encode(body).decode())
                while not decoder.done:
                    item = decoder.feed(await asyncio.wait_for(ws.recv(), self._client.timeout))
                    if isinstance(item, (TurnDelta, TurnResult)):
                        yield item
            except ConnectionClosed as exc:
                raise _base.closed_error(self._client.base_url, exc) from exc
        if decoder.result is None:  # pragma: no cover
            raise AgentrtError("the stream ended without a turn result")

    async def prune(self, intervals: Iterable[tuple[int, int]] | None = None, *, regions: Iterable[int] | None = None,
              kinds: Iterable[str] | None = None, tool_names: Iterable[str] | None = None,
              rounds: Iterable[int] | None = None, scorer: str | None = None,
              keep_ratio: float | None = None, keep_tokens: int | None = None) -> PruneResult:
        """Explicit ``intervals`` ``[(L, R), ...]``, or a region selector (``regions``, ``kinds``, ...)."""
        body = _base.drop_none(intervals=_list(intervals), regions=_list(regions), kinds=_list(kinds),
                               tool_names=_list(tool_names), rounds=_list(rounds), scorer=scorer,
                               keep_ratio=keep_ratio, keep_tokens=keep_tokens)
        return await self._client.request("POST", f"/v1/chains/{self.id}/prune", json=body, type=PruneResult)

    async def fork(self, metadata: Mapping[str, Any] | None = None) -> AsyncChain:
        body = _base.drop_none(metadata=metadata)
        return AsyncChain(self._client, await self._client.request("POST", f"/v1/chains/{self.id}/fork", json=body,
                                                        type=ChainRead))

    async def rewind(self, num_turns: int | None = None, *, num_tokens: int | None = None) -> ChainRead:
        body = _base.drop_none(num_turns=num_turns, num_tokens=num_tokens)
        self.info = await self._client.request("POST", f"/v1/chains/{self.id}/rewind", json=body, type=ChainRead)
        return self.info

    async def state(self, include_tokens: bool = False) -> ChainRead:
        self.info = await self._client.chains._read(self.id, include_tokens)
        return self.info

    async def delete(self) -> None:
        await self._client.request("DELETE", f"/v1/chains/{self.id}")


def _list(values: Iterable[Any] | None) -> list[Any] | None:
    return None if values is None else [list(v) if isinstance(v, tuple) else v for v in values]
