"""Pruning a chain's KV: an explicit prune request, the chain's pruning policy after a tool-result round, and the
think blocks the chat template leaves out. Each runs the engine's prune, then records a prune event and the
regions' kept tokens in one transaction; it is kept apart from the chain resources it acts on."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import msgspec
from sqlalchemy import func, select, update

from agentrt.chain_state import ChainState, policy_of, prune_event_row
from agentrt.errors import bad_field
from agentrt.models import ChainRow, PruneEventRow, RegionRow
from agentrt.tool_input_spans import covered
from engine.chain_index import ChainInfo, UnknownChainError
from engine.errors import ConfigError
from engine.registry import SCORERS
from sdk.schema import PruneEvent, PruneRequest, PruneResult, Region

if TYPE_CHECKING:
    from agentrt.chains import ChainService


class ChainPruner:
    """The prune operations of ``chains``' chains (ChainService delegates to it)."""

    def __init__(self, chains: ChainService):
        self.chains = chains

    async def prune(self, chain_id: str, data: PruneRequest, *, tenant: str) -> PruneResult:
        state = await self.chains.state(chain_id, tenant)
        await self.chains.hold(chain_id)
        try:
            if self.chains.leases is not None:
                state = await self.chains.state(chain_id, tenant)
            if data.scorer is not None:
                check_scorer(data.scorer, "scorer")
            check_keep(data.scorer, data.keep_ratio, data.keep_tokens)
            info = await self.chains.chain_info(chain_id)
            computed = info.computed_tokens if info is not None else 0
            selector = (data.regions, data.kinds, data.tool_names, data.rounds)
            if data.intervals is not None:
                if any(x is not None for x in selector):
                    raise bad_field("intervals", "give either intervals or a region selector, not both")
                if not data.intervals:
                    raise bad_field("intervals", "must not be empty")
                limit = computed if info is not None else len(state.token_ids)
                for i, (lo, hi) in enumerate(data.intervals):
                    if not lo < hi <= limit:
                        raise bad_field(f"intervals[{i}]", f"[{lo}, {hi}) must satisfy 0 <= L < R <= {limit} "
                                                           "(the chain's computed KV)")
                intervals = [(int(lo), int(hi)) for lo, hi in data.intervals]
                touched = [r.index for r in state.regions if any(lo < r.end and r.start < hi for lo, hi in intervals)]
            else:
                if all(x is None for x in selector):
                    raise bad_field("intervals", "give intervals or a region selector (regions, kinds, tool_names, "
                                                 "rounds)")
                for i, index in enumerate(data.regions or []):
                    if index >= len(state.regions):
                        raise bad_field(f"regions[{i}]", f"the chain has {len(state.regions)} regions")
                touched = [r.index for r in state.regions if _selected(r, data)]
                intervals = _region_intervals([r for r in state.regions if r.index in touched], computed,
                                              merge=data.keep_tokens is None)
            event, state = await self._prune(state, intervals, touched, data.scorer, data.keep_ratio, "explicit",
                                             info, data.keep_tokens)
            if self.chains.leases is None:
                self.chains.states[chain_id] = state
        finally:
            self.chains.let_go(chain_id)
        regions = [state.regions[i] for i in event.regions]
        return PruneResult(chain_id=chain_id, tokens_kept=event.tokens_kept, tokens_freed=event.tokens_freed,
                           pages_freed=event.pages_freed, event=event, regions=regions)

    async def drop_reasoning(self, state: ChainState, spans: list[tuple[int, int]]) -> ChainState:
        """The think blocks that the chat template leaves out of the conversation (agentrt.chat: Qwen3's drops
        earlier replies' reasoning) leave the chain's KV, as a prune: the token log keeps them, so the turn
        appends only its new messages and the model attends as the template shows the conversation. Call
        holding the chain."""
        info = await self.chains.chain_info(state.id)
        if info is None:  # no KV here: the turn recomputes the whole log, blocks included (as any prune is lost)
            return state
        pruned = [(int(lo), int(hi)) for lo, hi in state.row.pruned_intervals or []]
        due = [(lo, min(hi, info.computed_tokens)) for lo, hi in spans
               if lo < info.computed_tokens and not covered((lo, hi), pruned)]
        if not due:
            return state
        touched = [r.index for r in state.regions if any(lo < r.end and r.start < hi for lo, hi in due)]
        _, state = await self._prune(state, due, touched, None, 0.0, "template", info)
        return state

    async def apply_policy(self, state: ChainState) -> tuple[list[PruneEvent], ChainState]:
        """Right after a turn that appended a tool-result round commits (the chain is still held busy)."""
        policy = policy_of(state.row)
        if policy is None or state.tool_rounds == 0:
            return [], state
        newest = state.tool_rounds - 1
        live = [r for r in state.regions if r.kind == "tool_result" and not r.pruned
                and r.tool_name not in policy.exclude_tools]
        if sum(r.end - r.start for r in live) < policy.min_tool_tokens:
            return [], state
        due = [r for r in live if r.round is not None and r.round <= newest - policy.lag]
        if not due:
            return [], state
        info = await self.chains.chain_info(state.id)
        computed = info.computed_tokens if info is not None else 0
        intervals = _region_intervals(due, computed, merge=policy.keep_tokens is None)
        if info is None or not intervals:
            return [], state
        event, state = await self._prune(state, intervals, [r.index for r in due], policy.scorer, policy.keep_ratio,
                                         "policy", info, policy.keep_tokens)
        return [event], state

    async def _prune(self, state: ChainState, intervals: list[tuple[int, int]], touched: list[int],
                     scorer: str | None, keep_ratio: float, source: str, info: ChainInfo | None,
                     keep_tokens: int | None = None) -> tuple[PruneEvent, ChainState]:
        """With ``keep_tokens`` each interval keeps that many of its tokens (one engine prune per interval);
        with ``keep_ratio`` one prune keeps that share of them all."""
        chain_id = state.id
        pages_before = info.pages_held if info is not None else 0
        computed = info.computed_tokens if info is not None else 0
        tokens_kept = tokens_freed = pages_freed = 0
        if info is not None and intervals:
            calls = [intervals] if keep_tokens is None else [[iv] for iv in intervals]
            try:
                for part in calls:
                    res = await self.chains.worker.call(lambda e, part=part: e.prune_chain(
                        chain_id, part, scorer, keep_ratio, keep_tokens=keep_tokens), chain=chain_id)
                    tokens_kept, tokens_freed = res.tokens_kept, tokens_freed + res.tokens_freed
                    pages_freed += res.pages_freed
            except UnknownChainError:
                pass
        after = await self.chains.chain_info(chain_id) if info is not None else None
        pages_after = after.pages_held if after is not None else 0
        regions = list(state.regions)
        changed: list[Region] = []
        if tokens_freed > 0:
            for i in touched:
                r = regions[i]
                overlap = sum(max(0, min(hi, r.end) - max(lo, r.start)) for lo, hi in intervals)
                if overlap == 0:
                    continue
                if keep_tokens is None:
                    kept = max(0, r.kept_tokens - round((1.0 - keep_ratio) * overlap))
                else:  # each interval's drop shared by its regions in proportion to their overlap
                    kept = r.kept_tokens - sum(
                        round(max(0, (hi - lo) - keep_tokens) * max(0, min(hi, r.end) - max(lo, r.start)) / (hi - lo))
                        for lo, hi in intervals)
                    kept = max(0, kept)
                whole = overlap >= min(r.end, computed) - r.start  # all of it that has KV
                regions[i] = msgspec.structs.replace(r, pruned=r.pruned or whole, kept_tokens=kept)
                changed.append(regions[i])
        pruned_intervals = list(state.row.pruned_intervals or []) + ([list(iv) for iv in intervals]
                                                                      if tokens_freed > 0 else [])
        async with self.chains.db.sessions.begin() as s:
            await self.chains.fence(s, chain_id)
            index = await s.scalar(select(func.count()).select_from(PruneEventRow)
                                   .where(PruneEventRow.chain_id == chain_id)) or 0
            event = PruneEvent(index=index, source=source, created_at=time.time(), after_turn=state.num_turns,  # type: ignore[arg-type]
                               intervals=intervals, regions=touched, scorer=scorer, keep_ratio=keep_ratio,
                               keep_tokens=keep_tokens,
                               tokens_kept=tokens_kept, tokens_freed=tokens_freed, pages_freed=pages_freed,
                               pages_before=pages_before, pages_after=pages_after)
            s.add(prune_event_row(chain_id, event))
            for r in changed:
                await s.execute(update(RegionRow).where(RegionRow.chain_id == chain_id, RegionRow.index == r.index)
                                .values(pruned=r.pruned, kept_tokens=r.kept_tokens))
            await s.execute(update(ChainRow).where(ChainRow.id == chain_id).values(pruned_intervals=pruned_intervals))
        state.row.pruned_intervals = pruned_intervals
        if self.chains.metrics is not None:
            self.chains.metrics.record_prune(tokens_freed)
        return event, dataclasses.replace(state, regions=regions)


def check_scorer(name: str, key: str) -> None:
    try:
        SCORERS.get(name)
    except ConfigError as exc:
        raise bad_field(key, str(exc)) from None


def _selected(region: Region, data: PruneRequest) -> bool:
    return ((data.regions is None or region.index in data.regions)
            and (data.kinds is None or region.kind in data.kinds)
            and (data.tool_names is None or region.tool_name in data.tool_names)
            and (data.rounds is None or region.round in data.rounds))


def check_keep(scorer: str | None, keep_ratio: float, keep_tokens: int | None, prefix: str = "") -> None:
    if keep_tokens is not None and keep_ratio:
        raise bad_field(f"{prefix}keep_tokens", "give keep_ratio or keep_tokens, not both")
    if scorer is None and (0.0 < keep_ratio < 1.0 or bool(keep_tokens)):
        raise bad_field(f"{prefix}scorer", "keeping part of a pruned region needs a scorer to choose the kept tokens")


def _region_intervals(regions: list[Region], computed: int, merge: bool) -> list[tuple[int, int]]:
    """The regions' spans that have KV; merged when one prune covers them all (keep_ratio), one per region when
    each keeps its own token count (keep_tokens)."""
    spans = sorted((r.start, min(r.end, computed)) for r in regions if r.start < min(r.end, computed))
    return _merge(spans) if merge else spans


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out

