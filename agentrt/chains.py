"""Chains as resources: create, list, read, delete, and starting a turn (see agentrt.turns for the rest)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from sqlalchemy import delete, func, select

from agentrt.chain_state import ChainState, chain_read, chain_summary, kv_accounting, message_dict, state_from_rows
from agentrt.chat import ChatRenderer
from agentrt.config import ServerConfig
from agentrt.db import Database
from agentrt.engine_worker import EngineWorker
from agentrt.errors import ChainBusy, ChainNotFound, bad_field
from agentrt.metrics import Metrics
from agentrt.models import ChainRow, RegionRow, TurnRow
from agentrt.turns import PendingTurn
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from sdk.schema import ChainCreate, ChainStatus, ChainList, ChainRead, ChainSummary, TurnCreate


class ChainService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: ChatRenderer,
                 db: Database):
        self.config = config
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.db = db
        self.metrics: Metrics | None = None
        self.states: dict[str, ChainState] = {}
        self.busy: set[str] = set()
        self.num_chains = 0

    async def start(self) -> None:
        async with self.db.sessions() as s:
            self.num_chains = await s.scalar(select(func.count()).select_from(ChainRow)) or 0

    def counts(self) -> tuple[int, int]:
        return len(self.busy), self.num_chains

    def status(self, chain_id: str) -> ChainStatus:
        return "busy" if chain_id in self.busy else "idle"

    # --- CRUD -----------------------------------------------------------------------------------
    async def create(self, data: ChainCreate) -> ChainRead:
        engine = self.worker.engine
        if data.model is not None and data.model != self.model_name:
            raise bad_field("model", f"this server serves {self.model_name!r}, not {data.model!r}")
        if data.method is not None and data.method != engine.method.name:
            raise bad_field("method", f"this server runs method {engine.method.name!r}; per-chain methods are not "
                                      f"supported yet (start the server with --method)")
        if data.method_config is not None and data.method_config != dict(engine.config.method_config):
            raise bad_field("method_config", "must equal the server's method config (per-chain config is not "
                                             "supported yet)")
        tools = msgspec.to_builtins(data.tools)
        row = ChainRow(id=f"chain_{uuid.uuid4().hex}", created_at=time.time(), model=self.model_name,
                       method=engine.method.name, method_config=dict(engine.config.method_config),
                       system_prompt=data.system_prompt if data.system_prompt is not None
                       else self.config.default_system_prompt,
                       tools=tools, meta=data.metadata, num_turns=0, num_tokens=0)
        self.renderer.render([{"role": "system", "content": row.system_prompt}], tools)
        async with self.db.sessions.begin() as s:
            s.add(row)
        self.num_chains += 1
        self.states[row.id] = ChainState(row=row)
        return chain_read(row, "idle", [], [], kv_accounting(0, None), False)

    async def page(self, offset: int, limit: int) -> ChainList:
        async with self.db.sessions() as s:
            total = await s.scalar(select(func.count()).select_from(ChainRow)) or 0
            rows = (await s.scalars(select(ChainRow).order_by(ChainRow.created_at, ChainRow.id)
                                    .offset(offset).limit(limit))).all()
        data: list[ChainSummary] = [chain_summary(r, self.status(r.id)) for r in rows]
        return ChainList(data=data, offset=offset, limit=limit, total=total, has_more=offset + len(rows) < total)

    async def read(self, chain_id: str, include_tokens: bool = False) -> ChainRead:
        chain, turns, regions = await self._rows(chain_id)
        kv = kv_accounting(chain.num_tokens, await self._chain_info(chain_id))
        return chain_read(chain, self.status(chain_id), turns, regions, kv, include_tokens)

    async def delete(self, chain_id: str) -> None:
        if chain_id in self.busy:
            raise ChainBusy(chain_id)
        self.busy.add(chain_id)
        try:
            async with self.db.sessions.begin() as s:
                if await s.get(ChainRow, chain_id) is None:
                    raise ChainNotFound(chain_id)
                await s.execute(delete(RegionRow).where(RegionRow.chain_id == chain_id))
                await s.execute(delete(TurnRow).where(TurnRow.chain_id == chain_id))
                await s.execute(delete(ChainRow).where(ChainRow.id == chain_id))
            self.states.pop(chain_id, None)
            self.num_chains -= 1
            if hasattr(self.worker.engine, "delete_chain"):
                await self._engine_call(lambda e: e.delete_chain(chain_id))
        finally:
            self.busy.discard(chain_id)

    # --- turns ----------------------------------------------------------------------------------
    async def start_turn(self, chain_id: str, data: TurnCreate) -> PendingTurn:
        """Render, submit and return the running turn; raises 404 / 409 / 400 / 422 before anything changes."""
        state = await self.state(chain_id)
        if chain_id in self.busy:
            raise ChainBusy(chain_id)
        self.busy.add(chain_id)
        try:
            params = self._sampling(data)
            messages = [message_dict(m) for m in data.messages]
            for m in messages:
                if m["role"] == "tool" and m.get("name") is None:
                    m["name"] = state.tool_names.get(m["tool_call_id"])
            new = ([state.system_message()] if state.num_turns == 0 else []) + messages
            last = state.token_ids[-1] if state.token_ids else None
            appended = self.renderer.append(state.history, new, state.row.tools, last, data.assistant_prefix)
            prompt = state.token_ids + appended.token_ids
            stream = await self.worker.submit(prompt, params, chain_id=chain_id)
        except BaseException:
            self.busy.discard(chain_id)
            raise
        return PendingTurn(self, state, data, messages, appended, prompt, stream)

    def finish_turn(self, chain_id: str, new_state: ChainState | None) -> None:
        if new_state is not None:
            self.states[chain_id] = new_state
        self.busy.discard(chain_id)

    async def state(self, chain_id: str) -> ChainState:
        state = self.states.get(chain_id)
        if state is None:
            state = state_from_rows(*await self._rows(chain_id))
            state = self.states.setdefault(chain_id, state)
        return state

    # --- helpers --------------------------------------------------------------------------------
    def _sampling(self, data: TurnCreate) -> SamplingParams:
        s = data.sampling
        if s.max_tokens > self.config.max_tokens_per_turn:
            raise bad_field("sampling.max_tokens", f"must be <= {self.config.max_tokens_per_turn}")
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                              max_tokens=s.max_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                              ignore_eos=s.ignore_eos)

    async def _rows(self, chain_id: str) -> tuple[ChainRow, list[TurnRow], list[RegionRow]]:
        async with self.db.sessions() as s:
            chain = await s.get(ChainRow, chain_id)
            if chain is None:
                raise ChainNotFound(chain_id)
            turns = (await s.scalars(select(TurnRow).where(TurnRow.chain_id == chain_id)
                                     .order_by(TurnRow.index))).all()
            regions = (await s.scalars(select(RegionRow).where(RegionRow.chain_id == chain_id)
                                       .order_by(RegionRow.index))).all()
        return chain, list(turns), list(regions)

    async def _chain_info(self, chain_id: str) -> Any:
        if not hasattr(self.worker.engine, "chain_info"):
            return None
        return await self._engine_call(lambda e: e.chain_info(chain_id))

    async def _engine_call(self, fn: Any) -> Any:
        try:
            return await self.worker.call(fn)
        except InvalidRequestError:  # the engine does not know the chain (new, reclaimed or after a restart)
            return None
