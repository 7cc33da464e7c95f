"""Wire types of the agentrt server, shared by the server and the SDK (msgspec Structs, JSON on the wire).

Input types forbid unknown fields. Token spans are half-open ``[start, end)`` offsets into the chain's
append-only token log.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

RegionKind = Literal["system", "user", "assistant", "tool_result"]
ResumeStatus = Literal["created", "resumed", "recomputed", "loaded"]
FinishReason = Literal["stop", "length", "abort"]
ChainStatus = Literal["idle", "busy"]

Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Text = Annotated[str, Meta(max_length=4_000_000)]


class _Input(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# --- tools ---------------------------------------------------------------------------------------
class FunctionDef(_Input, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Input, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as in the OpenAI API


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# --- chains --------------------------------------------------------------------------------------
class ChainCreate(_Input, kw_only=True):
    model: str | None = None  # must name the served model when given
    method: str | None = None  # must equal the engine's sparse method when given (one method per server today)
    method_config: dict[str, Any] | None = None
    system_prompt: Text | None = None
    tools: list[Tool] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    prune_policy: PrunePolicy | None = None


class PrunePolicy(_Input, kw_only=True):
    """Server-side pruning of tool results, applied right after each turn commits (see docs/server.md).

    After a turn that appends tool-result round ``k``, every unpruned tool_result region with round
    ``<= k - lag`` (tool not in ``exclude_tools``) is pruned, provided the chain holds at least
    ``min_tool_tokens`` unpruned tool-result tokens: the ``lag`` most recent rounds stay whole.
    """

    lag: Annotated[int, Meta(ge=0, le=1_000_000)] = 2
    keep_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    keep_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None  # per pruned region, instead of keep_ratio
    scorer: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    min_tool_tokens: Annotated[int, Meta(ge=0)] = 0
    exclude_tools: list[Annotated[str, Meta(min_length=1, max_length=256)]] = field(default_factory=list)


class KVAccounting(Struct, kw_only=True):
    logical_tokens: int  # length of the chain's token log
    resident: bool  # whether the engine holds KV for the chain right now
    computed_tokens: int = 0  # leading tokens whose KV the engine holds
    physical_tokens: int = 0  # slots held (the longest layer; less than computed after eviction)
    pages: int = 0  # pages the chain holds (the engine's ChainInfo.pages_held)
    physical_tokens_per_layer: list[int] = field(default_factory=list)
    engine_status: str | None = None  # the engine's view: busy | idle | reclaimed; None when it does not know the chain
    compacted: bool = False
    pinned: bool = False


class Region(Struct, kw_only=True):
    index: int
    kind: RegionKind
    start: int
    end: int
    turn: int  # the turn that appended it
    round: int | None = None  # tool-result round (0, 1, ...) for tool_result regions
    tool_name: str | None = None
    tool_call_id: str | None = None
    pruned: bool = False
    kept_tokens: int = 0


Interval = tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)]]


class PruneRequest(_Input, kw_only=True):
    """Either explicit ``intervals`` ``[[L, R), ...]`` in chain token positions, or a region selector:
    the regions matching every given field (``regions`` indices, ``kinds``, ``tool_names``, ``rounds``)."""

    intervals: Annotated[list[Interval], Meta(max_length=4096)] | None = None
    regions: list[Annotated[int, Meta(ge=0)]] | None = None
    kinds: list[RegionKind] | None = None
    tool_names: list[str] | None = None
    rounds: list[Annotated[int, Meta(ge=0)]] | None = None
    scorer: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    keep_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # instead of keep_ratio: tokens kept of each selected region (or of each explicit interval)
    keep_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None


class PruneEvent(Struct, kw_only=True):
    index: int  # 0, 1, ... per chain
    source: Literal["explicit", "policy", "template"]
    created_at: float
    after_turn: int  # the number of turns the chain had when it was pruned
    intervals: list[tuple[int, int]]
    regions: list[int]  # indices of the regions it touched
    scorer: str | None
    keep_ratio: float
    tokens_kept: int
    tokens_freed: int
    pages_freed: int
    pages_before: int  # the chain's pages (ChainInfo.pages_held) just before and just after
    pages_after: int
    keep_tokens: int | None = None


class PruneResult(Struct, kw_only=True):
    chain_id: str
    tokens_kept: int  # the engine's PruneResult
    tokens_freed: int
    pages_freed: int
    event: PruneEvent
    regions: list[Region]  # the regions it touched, as they are now


class ForkRequest(_Input, kw_only=True):
    metadata: dict[str, Any] | None = None  # default: the parent's metadata


class HintsRequest(_Input, kw_only=True):
    """Session hints for a chain's KV: ``pin`` (never moved off the device), ``priority`` (under pressure lower
    priorities leave the device first; default 0), ``ttl_seconds`` (dropped after that long idle; null: keep
    the current, ``clear_ttl``: none), ``release`` (off the device now: to host memory when the server has a tier,
    else dropped), ``prefetch`` (load it back now: an agent about to send a tool result warms its chain)."""

    pin: bool | None = None
    priority: Annotated[int, Meta(ge=-1000, le=1000)] | None = None
    ttl_seconds: Annotated[float, Meta(gt=0)] | None = None
    clear_ttl: bool = False
    release: bool = False
    prefetch: bool = False


class TurnHints(_Input, kw_only=True):
    """Session hints a turn carries for its chain's KV, applied when the turn has ended: ``pin``, ``priority``,
    ``ttl_seconds`` as on ``POST /v1/chains/{id}/hints``, and ``release_after`` (off the device as soon as the turn
    ends: an agent that will run a long tool call)."""

    pin: bool | None = None
    priority: Annotated[int, Meta(ge=-1000, le=1000)] | None = None
    ttl_seconds: Annotated[float, Meta(gt=0)] | None = None
    release_after: bool = False


class RewindRequest(_Input, kw_only=True):
    """Exactly one of: ``num_turns`` to keep, or ``num_tokens`` (must fall on a turn boundary)."""

    num_turns: Annotated[int, Meta(ge=0)] | None = None
    num_tokens: Annotated[int, Meta(ge=0)] | None = None


class Usage(Struct, kw_only=True):
    prompt_tokens: int  # the whole prompt of the turn (the chain's log before generation)
    appended_tokens: int  # tokens this turn added before generating
    prefilled_tokens: int  # tokens computed this turn
    resumed_tokens: int  # tokens whose KV was re-attached from the chain
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int


class AssistantMessage(Struct, kw_only=True):
    content: str  # the assistant prefix (if any) followed by the generated text, exactly as produced
    tool_calls: list[ToolCall] = field(default_factory=list)
    role: Literal["assistant"] = "assistant"


# --- turns ---------------------------------------------------------------------------------------
class UserMessage(_Input, kw_only=True, tag_field="role", tag="user"):
    content: Text


class ToolResultMessage(_Input, kw_only=True, tag_field="role", tag="tool"):
    content: Text
    tool_call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: str | None = None  # defaults to the name of the call with that id, when the chain made it


TurnMessage = UserMessage | ToolResultMessage


# --- structured outputs (OpenAI's shapes) ----------------------------------------------------------
class JsonSchemaSpec(_Input, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # accepted: the output follows the schema either way


class TextFormat(_Input, tag_field="type", tag="text", kw_only=True):
    pass


class JsonObjectFormat(_Input, tag_field="type", tag="json_object", kw_only=True):
    pass


class JsonSchemaFormat(_Input, tag_field="type", tag="json_schema", kw_only=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class ToolChoiceFunction(_Input, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]


class NamedToolChoice(_Input, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class Sampling(_Input, kw_only=True):
    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Seed | None = None
    max_tokens: Annotated[int, Meta(ge=1)] = 128
    # max_tokens as a ceiling: above the server's max_tokens_per_turn it is lowered to it (not a 400), and to what
    # the model's context and KV pool hold for the prompt (the turn ends with finish_reason "length" there)
    fit_max_tokens: bool = False
    stop: list[Annotated[str, Meta(min_length=1)]] = field(default_factory=list)
    stop_token_ids: list[Annotated[int, Meta(ge=0, le=2**31)]] = field(default_factory=list)
    ignore_eos: bool = False
    # emitted first, in order, by real decode steps (replays, deterministic tests); each id < the vocabulary
    forced_token_ids: Annotated[list[Annotated[int, Meta(ge=0, le=2**31)]], Meta(max_length=65536)] = field(
        default_factory=list)
    # constrained decoding (docs/structured-outputs.md): the reply is JSON (of a schema), or tool calls of the
    # chain's tools ("required": one or more; a named function: one call of it; "auto": free text or calls)
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call under "required"


class TurnCreate(_Input, kw_only=True):
    messages: Annotated[list[TurnMessage], Meta(min_length=1, max_length=1024)]
    assistant_prefix: Text | None = None  # generation continues this text
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = False
    hints: TurnHints | None = None  # applied to the chain's KV when the turn has ended


class TurnResult(Struct, kw_only=True):
    chain_id: str
    turn: int
    message: AssistantMessage
    finish_reason: FinishReason
    usage: Usage
    resume_status: ResumeStatus
    pruned: list[PruneEvent] = field(default_factory=list)  # what the chain's policy pruned after this turn


class TurnDelta(Struct, kw_only=True):
    """One SSE ``delta`` event of a streamed turn; the final event (``done``) carries a TurnResult."""

    text: str
    token_ids: list[int]


class TurnRead(Struct, kw_only=True):
    index: int
    messages: list[TurnMessage]
    assistant_prefix: str | None
    sampling: Sampling
    message: AssistantMessage
    finish_reason: FinishReason
    usage: Usage
    resume_status: ResumeStatus
    created_at: float
    appended_token_ids: list[int] | None = None  # with ?include_tokens=true
    generated_token_ids: list[int] | None = None


class ChainSummary(Struct, kw_only=True):
    id: str
    created_at: float
    model: str
    method: str
    status: ChainStatus
    num_turns: int
    num_tokens: int
    metadata: dict[str, Any]


class ChainRead(ChainSummary, kw_only=True):
    method_config: dict[str, Any]
    system_prompt: str
    tools: list[Tool]
    turns: list[TurnRead]
    regions: list[Region]
    kv: KVAccounting
    prune_policy: PrunePolicy | None = None
    pruned_intervals: list[tuple[int, int]] = field(default_factory=list)  # KV dropped now (clears on recompute)
    prune_events: list[PruneEvent] = field(default_factory=list)
    parent_id: str | None = None  # the chain it was forked from
    token_ids: list[int] | None = None  # the token log, with ?include_tokens=true


class ChainList(Struct, kw_only=True):
    data: list[ChainSummary]
    offset: int
    limit: int
    total: int
    has_more: bool


# --- errors --------------------------------------------------------------------------------------
class ErrorDetail(Struct, kw_only=True, omit_defaults=True):
    message: str
    key: str | None = None  # the offending field, dotted (``sampling.max_tokens``)
    source: str | None = None  # body | query | path


class ErrorBody(Struct, kw_only=True, omit_defaults=True):
    status_code: int
    detail: str
    extra: list[ErrorDetail] | None = None


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
