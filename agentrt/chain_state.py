"""A chain as the server holds it between turns, and its conversions to and from rows and wire types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from agentrt.chat import Message
from agentrt.models import ChainRow, PruneEventRow, RegionRow, TurnRow
from engine.chain_index import ChainInfo
from sdk.schema import (AssistantMessage, ChainRead, ChainStatus, ChainSummary, FinishReason, KVAccounting,
                        PruneEvent, PrunePolicy, Region, RegionKind, ResumeStatus, Sampling, Tool, ToolCall,
                        TurnMessage, TurnRead, Usage)


@dataclass(slots=True)
class ChainState:
    """What the next turn needs: the token log, the messages to render, the regions. Replaced, never mutated."""

    row: ChainRow
    token_ids: list[int] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    tool_names: dict[str, str] = field(default_factory=dict)
    num_turns: int = 0
    tool_rounds: int = 0

    @property
    def id(self) -> str:
        return self.row.id

    def system_message(self) -> Message:
        return {"role": "system", "content": self.row.system_prompt}


def message_dict(message: TurnMessage) -> Message:
    return msgspec.to_builtins(message)


def state_from_rows(chain: ChainRow, turns: list[TurnRow], regions: list[RegionRow]) -> ChainState:
    state = ChainState(row=chain, regions=[region_from_row(r) for r in regions], num_turns=len(turns))
    if turns:
        state.history.append(state.system_message())
    for turn in turns:
        state.token_ids += turn.appended_token_ids + turn.generated_token_ids
        state.history += turn.messages
        state.history.append({"role": "assistant", "content": turn.content})
        state.tool_names.update({c["id"]: c["function"]["name"] for c in turn.tool_calls})
        state.tool_rounds += any(m["role"] == "tool" for m in turn.messages)
    return state


def region_from_row(row: RegionRow) -> Region:
    return Region(index=row.index, kind=cast(RegionKind, row.kind), start=row.start, end=row.end, turn=row.turn, round=row.round,
                  tool_name=row.tool_name, tool_call_id=row.tool_call_id, pruned=row.pruned,
                  kept_tokens=row.kept_tokens)


def region_row(chain_id: str, region: Region) -> RegionRow:
    return RegionRow(chain_id=chain_id, **msgspec.structs.asdict(region))


def turn_read(row: TurnRow, include_tokens: bool) -> TurnRead:
    return TurnRead(
        index=row.index,
        messages=msgspec.convert(row.messages, list[TurnMessage]),
        assistant_prefix=row.assistant_prefix,
        sampling=msgspec.convert(row.sampling, Sampling),
        message=AssistantMessage(content=row.content, tool_calls=msgspec.convert(row.tool_calls, list[ToolCall])),
        finish_reason=cast(FinishReason, row.finish_reason),
        usage=msgspec.convert(row.usage, Usage),
        resume_status=cast(ResumeStatus, row.resume_status),
        created_at=row.created_at,
        appended_token_ids=row.appended_token_ids if include_tokens else None,
        generated_token_ids=row.generated_token_ids if include_tokens else None,
    )


def chain_summary(row: ChainRow, status: ChainStatus) -> ChainSummary:
    return ChainSummary(id=row.id, created_at=row.created_at, model=row.model, method=row.method, status=status,
                        num_turns=row.num_turns, num_tokens=row.num_tokens, metadata=row.meta)


def prune_event(row: PruneEventRow) -> PruneEvent:
    return PruneEvent(index=row.index, source=cast(Any, row.source), created_at=row.created_at,
                      after_turn=row.after_turn, intervals=[(int(a), int(b)) for a, b in row.intervals],
                      regions=list(row.regions), scorer=row.scorer, keep_ratio=row.keep_ratio,
                      tokens_kept=row.tokens_kept, tokens_freed=row.tokens_freed, pages_freed=row.pages_freed,
                      pages_before=row.pages_before, pages_after=row.pages_after, keep_tokens=row.keep_tokens)


def prune_event_row(chain_id: str, event: PruneEvent) -> PruneEventRow:
    fields = msgspec.to_builtins(event)
    return PruneEventRow(chain_id=chain_id, **fields)


def policy_of(row: ChainRow) -> PrunePolicy | None:
    return None if row.prune_policy is None else msgspec.convert(row.prune_policy, PrunePolicy)


def chain_read(row: ChainRow, status: ChainStatus, turns: list[TurnRow], regions: list[RegionRow],
               kv: KVAccounting, include_tokens: bool, events: list[PruneEventRow] | None = None) -> ChainRead:
    summary = msgspec.structs.asdict(chain_summary(row, status))
    tokens = [t for turn in turns for t in turn.appended_token_ids + turn.generated_token_ids]
    return ChainRead(
        **summary,
        method_config=row.method_config,
        system_prompt=row.system_prompt,
        tools=msgspec.convert(row.tools, list[Tool]),
        turns=[turn_read(t, include_tokens) for t in turns],
        regions=[region_from_row(r) for r in regions],
        kv=kv,
        prune_policy=policy_of(row),
        pruned_intervals=[(int(a), int(b)) for a, b in row.pruned_intervals or []],
        prune_events=[prune_event(e) for e in events or []],
        parent_id=row.parent_id,
        token_ids=tokens if include_tokens else None,
    )


def kv_accounting(logical_tokens: int, info: ChainInfo | None) -> KVAccounting:
    """From the engine's ChainInfo when it holds the chain (None: it does not, e.g. after a restart)."""
    if info is None:
        return KVAccounting(logical_tokens=logical_tokens, resident=False)
    return KVAccounting(logical_tokens=logical_tokens, resident=info.pages_held > 0,
                        computed_tokens=info.computed_tokens, physical_tokens=max(info.physical_tokens, default=0),
                        pages=info.pages_held, physical_tokens_per_layer=list(info.physical_tokens),
                        engine_status=info.status, compacted=info.compacted, pinned=info.pinned)
