"""A running turn: streams the engine's deltas, then commits the turn in one transaction.

Nothing is written before generation ends: an aborted or failed turn leaves the chain (in memory and in the
database) as it was. Once generation has finished the commit runs to the end even if the client has gone.
A route that keeps rows of its own about the turn (agentrt.responses) sets ``PendingTurn.extra_rows``: they are
written in the turn's transaction, so they exist exactly when the turn does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, cast

import msgspec
from sqlalchemy import update

from agentrt.chain_state import ChainState, policy_of, region_row
from agentrt.chat import Appended, Message
from agentrt.engine_worker import RequestStream, prefill_counts
from agentrt.errors import TurnFailed
from agentrt.models import ChainRow, RegionRow, TurnRow
from engine.chain_index import ResumeStatus as EngineResumeStatus
from engine.outputs import RequestOutput
from sdk.schema import (AssistantMessage, FinishReason, Region, ResumeStatus, TurnCreate, TurnDelta, TurnResult,
                        Usage)

if TYPE_CHECKING:
    from agentrt.chains import ChainService

log = logging.getLogger(__name__)


class PendingTurn:
    def __init__(self, service: ChainService, state: ChainState, data: TurnCreate, messages: list[Message],
                 appended: Appended, prompt: list[int], stream: RequestStream):
        self.service = service
        self.state = state
        self.data = data
        self.messages = messages
        self.appended = appended
        self.prompt = prompt
        self.stream = stream
        self._started = False
        # rows written in the turn's transaction, made from its result and its generated token ids
        self.extra_rows: Callable[[TurnResult, list[int]], Iterable[Any]] | None = None

    async def result(self) -> TurnResult:
        final = None
        async with aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, TurnResult):
                    final = event
        assert final is not None
        return final

    async def events(self) -> AsyncGenerator[TurnDelta | TurnResult, None]:
        self._started = True
        commit: asyncio.Future[TurnResult] | None = None
        outcome = "aborted"
        try:
            last: RequestOutput | None = None
            async with aclosing(self.stream.outputs()) as outputs:
                async for out in outputs:
                    last = out
                    if out.new_token_ids or out.new_text:
                        yield TurnDelta(text=out.new_text, token_ids=list(out.new_token_ids))
            if last is None or last.finish_reason == "abort":
                raise TurnFailed(detail="the turn was aborted before it finished")
            commit = asyncio.ensure_future(self._commit(last))
            yield await asyncio.shield(commit)
        except Exception:
            outcome = "failed"
            raise
        finally:
            if commit is None:  # nothing was written; once a commit has started, it releases the chain itself
                self._count(outcome)
                self.service.finish_turn(self.state.id, None)

    async def close(self) -> None:
        """For a turn whose events were never consumed (the response never started)."""
        if not self._started:
            self._started = True
            self.stream.done = True
            self.stream.worker.abort(self.stream.request_id)
            self.service.finish_turn(self.state.id, None)

    def _count(self, outcome: str) -> None:
        if self.service.metrics is not None:
            self.service.metrics.turns.labels(outcome).inc()

    async def _commit(self, out: RequestOutput) -> TurnResult:
        result = await self._commit_turn(out)
        if self.data.hints is not None:  # the turn is committed: hints never fail it
            await self.service.apply_turn_hints(self.state.id, self.data.hints)
        return result

    async def _commit_turn(self, out: RequestOutput) -> TurnResult:
        new_state = None
        try:
            result, new_state = await self._write(out)
            self._count("ok")
            if any(p.kind == "tool_result" for p in self.appended.pieces):
                try:  # the turn is committed; a failed policy application leaves it so
                    events, new_state = await self.service.apply_policy(new_state)
                    result.pruned = events
                except Exception:
                    log.exception("pruning policy of %s failed", self.state.id)
            return result
        except BaseException:
            self._count("failed")
            raise
        finally:
            await self.service.release(self.state.id)
            self.service.finish_turn(self.state.id, new_state)

    async def _write(self, out: RequestOutput) -> tuple[TurnResult, ChainState]:
        st, appended, chain_id = self.state, self.appended, self.state.id
        generated = list(out.token_ids)
        turn = st.num_turns
        prefilled, resumed, cached = prefill_counts(out)
        engine_status = out.resume_status or EngineResumeStatus.CREATED
        if engine_status is EngineResumeStatus.CREATED and turn > 0:
            # the engine did not know the chain: a restart, or a fork whose KV the engine could not copy
            engine_status = EngineResumeStatus.RECOMPUTED
        status = cast(ResumeStatus, engine_status.value)  # the wire's and the database's plain string
        content = (self.data.assistant_prefix or "") + out.text
        calls = self.service.renderer.reader(st.row.tools).reply_calls(content)
        usage = Usage(prompt_tokens=len(self.prompt), appended_tokens=len(appended.token_ids),
                      prefilled_tokens=prefilled, resumed_tokens=resumed, cached_tokens=cached,
                      completion_tokens=len(generated))

        regions = list(st.regions)
        reset = engine_status is EngineResumeStatus.RECOMPUTED and any(r.pruned for r in regions)
        if reset:  # the KV was computed afresh from the whole log: no earlier pruning is in effect any more
            regions = [msgspec.structs.replace(r, pruned=False, kept_tokens=r.end - r.start) for r in regions]
        closed: Region | None = None
        if appended.close_ids and regions:
            last_region = regions[-1]
            end = last_region.end + len(appended.close_ids)
            closed = regions[-1] = msgspec.structs.replace(
                last_region, end=end, kept_tokens=last_region.kept_tokens + len(appended.close_ids))
        new_regions: list[Region] = []
        pos = len(st.token_ids) + len(appended.close_ids)
        for piece in appended.pieces:
            end = pos + len(piece.token_ids)
            tool = piece.kind == "tool_result"
            new_regions.append(Region(index=len(regions) + len(new_regions), kind=piece.kind, start=pos, end=end,
                                      turn=turn, round=st.tool_rounds if tool else None,
                                      tool_name=piece.message.get("name") if tool else None,
                                      tool_call_id=piece.message.get("tool_call_id"), kept_tokens=end - pos))
            pos = end
        end = len(self.prompt) + len(generated)
        new_regions.append(Region(index=len(regions) + len(new_regions), kind="assistant", start=pos, end=end,
                                  turn=turn, kept_tokens=end - pos))

        row = TurnRow(chain_id=chain_id, index=turn, created_at=time.time(), messages=self.messages,
                      assistant_prefix=self.data.assistant_prefix, sampling=msgspec.to_builtins(self.data.sampling),
                      content=content, tool_calls=msgspec.to_builtins(calls), finish_reason=out.finish_reason,
                      resume_status=status, appended_token_ids=appended.token_ids, generated_token_ids=generated,
                      usage=msgspec.to_builtins(usage))
        token_ids = self.prompt + generated
        result = TurnResult(chain_id=chain_id, turn=turn, message=AssistantMessage(content=content, tool_calls=calls),
                            finish_reason=cast(FinishReason, out.finish_reason), usage=usage,
                            resume_status=status)
        async with self.service.db.sessions.begin() as s:
            # the lease goes with the commit unless a pruning policy runs next (it is released after that)
            policy_next = policy_of(st.row) is not None and any(p.kind == "tool_result" for p in appended.pieces)
            await self.service.fence(s, chain_id, getattr(self.stream, "replica", None), release=not policy_next)
            s.add(row)
            if self.extra_rows is not None:
                s.add_all(self.extra_rows(result, generated))
            if closed is not None:
                await s.execute(update(RegionRow).where(RegionRow.chain_id == chain_id, RegionRow.index == closed.index)
                                .values(end=closed.end, kept_tokens=closed.kept_tokens))
            s.add_all(region_row(chain_id, r) for r in new_regions)
            if reset:
                await s.execute(update(RegionRow).where(RegionRow.chain_id == chain_id, RegionRow.turn < turn)
                                .values(pruned=False, kept_tokens=RegionRow.end - RegionRow.start))
            await s.execute(update(ChainRow).where(ChainRow.id == chain_id)
                            .values(num_turns=turn + 1, num_tokens=len(token_ids),
                                    **({"pruned_intervals": []} if reset else {})))
        if reset:
            st.row.pruned_intervals = []

        new_state = ChainState(
            row=st.row, token_ids=token_ids,
            history=st.history + [p.message for p in appended.pieces] + [{"role": "assistant", "content": content}],
            regions=regions + new_regions, tool_names={**st.tool_names, **{c.id: c.function.name for c in calls}},
            num_turns=turn + 1, tool_rounds=st.tool_rounds + any(p.kind == "tool_result" for p in appended.pieces))
        if self.service.metrics is not None:
            self.service.metrics.record_request(prefilled, resumed, cached, len(generated))
        return result, new_state
