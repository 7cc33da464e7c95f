"""Responses as database rows (agentrt.models.ResponseRow), and the lookups GET, DELETE, input_items and
``previous_response_id`` make.

The map response -> (chain, turn) is a row per response (its tenant, chain, turn, ``store`` flag, the response
object and, when stored, its input items), for every response, of an implicit chain too: a later
``previous_response_id`` continues it. The row is written in the transaction that commits the chain turn
(``PendingTurn.extra_rows``), so a failed or aborted turn leaves none, and it is deleted with its chain (ON DELETE
CASCADE: deleting the chain, a conversation, or an implicit chain evicted). So responses survive a restart (the
next turn recomputes the KV the restart dropped). A rewind of the chain (the chain API) leaves its responses.
``ResponseStore.records`` caches the latest responses of this process (a bounded LRU, without input items); an
entry is used only while its chain's state is loaded here (ChainService.states, which deleting the chain drops),
else the row is read again. ``store: false``: the response is not retrievable (GET / DELETE / input_items answer
404; its input items are not kept) but it can still be continued. Another tenant's response id is a 404.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.exceptions import NotFoundException
from sqlalchemy import delete

from agentrt.models import ResponseRow
from agentrt.responses_types import (InputItemList, OutputFunctionCall, OutputMessage, OutputReasoning,
                                     ResponseObject)

OUTPUT_TYPES = {"message": OutputMessage, "function_call": OutputFunctionCall, "reasoning": OutputReasoning}
CACHED_RECORDS = 1024  # ResponseStore.records: the latest responses read or made by this process


class ResponseNotFound(NotFoundException):
    def __init__(self, response_id: str):
        super().__init__(detail=f"no response with the id {response_id!r}")


@dataclass(slots=True)
class Record:
    """A response (its row less the input items): the chain turn it is."""

    tenant: str
    chain_id: str
    turn: int  # the chain turn's index (the chain has turn + 1 turns right after it)
    stored: bool
    response: ResponseObject | None = None  # None until the turn is committed


class ResponseStore:
    """The response rows of one server (``chains``: its ChainService, for the database and the loaded states)."""

    def __init__(self, chains: Any):
        self.chains = chains
        self.records: OrderedDict[str, Record] = OrderedDict()  # a cache of the rows (module docstring)

    def remember(self, response_id: str, record: Record) -> None:
        self.records[response_id] = record
        self.records.move_to_end(response_id)
        while len(self.records) > CACHED_RECORDS:
            self.records.popitem(last=False)

    async def _row(self, response_id: str) -> ResponseRow | None:
        if "\x00" in response_id:  # no response has one (and PostgreSQL cannot even compare it)
            return None
        async with self.chains.db.sessions() as s:
            return await s.get(ResponseRow, response_id)

    async def record(self, response_id: str, tenant: str) -> Record | None:
        """The response's record, None when there is none for ``tenant``: from the cache while its chain's state
        is loaded (deleting the chain drops both), else from its row."""
        record = self.records.get(response_id)
        if record is not None and record.chain_id in self.chains.states:
            self.records.move_to_end(response_id)
        else:
            row = await self._row(response_id)
            if row is None:
                self.records.pop(response_id, None)
                return None
            record = Record(tenant=row.tenant, chain_id=row.chain_id, turn=row.turn, stored=row.stored,
                            response=_response_object(row.response))
            self.remember(response_id, record)
        return record if record.tenant == tenant else None

    async def _stored(self, response_id: str, tenant: str) -> Record:
        record = await self.record(response_id, tenant)
        if record is None or not record.stored or record.response is None:
            raise ResponseNotFound(response_id)
        return record

    async def get(self, response_id: str, tenant: str) -> ResponseObject:
        return (await self._stored(response_id, tenant)).response  # type: ignore[return-value]

    async def delete(self, response_id: str, tenant: str) -> None:
        """The response is forgotten (its chain and turn stay: they belong to the chain API)."""
        await self._stored(response_id, tenant)
        async with self.chains.db.sessions.begin() as s:
            deleted = (await s.execute(delete(ResponseRow).where(ResponseRow.id == response_id))).rowcount
        self.records.pop(response_id, None)
        if not deleted:  # deleted meanwhile (with its chain, or by a concurrent DELETE)
            raise ResponseNotFound(response_id)

    async def input_items(self, response_id: str, tenant: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> InputItemList:
        row = await self._row(response_id)
        if row is None or row.tenant != tenant or not row.stored:
            raise ResponseNotFound(response_id)
        items = list(row.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _response_object(stored: dict[str, Any]) -> ResponseObject:
    """A response object as its row holds it (``msgspec.to_builtins``), its output items typed again."""
    response = msgspec.convert(stored, ResponseObject)
    return msgspec.structs.replace(response, output=[msgspec.convert(o, OUTPUT_TYPES[o["type"]])
                                                     for o in response.output])
