"""Cancel a request's work when its client disconnects (non-streaming routes; streams are cancelled by Litestar)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from litestar import Request
from litestar.exceptions import HTTPException

T = TypeVar("T")


class ClientDisconnected(HTTPException):
    status_code = 499


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    if task.cancelled():
        raise ClientDisconnected(detail="client disconnected")
    return task.result()
