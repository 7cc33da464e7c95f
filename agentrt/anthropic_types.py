"""Wire types of Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as this
server takes and answers them (msgspec Structs).

Inputs forbid unknown fields (a 400 naming the field), as every other route's do. Block types this server
cannot honor (images, documents, thinking) are still decoded, loosely, so that the refusal can say why rather
than that the type is unknown; fields refused whatever their value (``thread``, ``compaction``)
refuse themselves as they are decoded, with the reason. What each field does here is
tabled in docs/anthropic.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType, field

Text = Annotated[str, Meta(max_length=4_000_000)]
CacheControl = dict[str, Any]  # {"type": "ephemeral", "ttl": ...}: accepted, no effect (chains reuse the KV anyway)


class _Input(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Refused(Struct, kw_only=True):
    """A block type this server refuses: decoded with any fields, so that the 400 names the block's type."""


# --- content blocks --------------------------------------------------------------------------------------
class TextBlockParam(_Input, tag_field="type", tag="text"):
    text: Text
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # accepted, no effect (this server returns none)


class ImageBlockParam(_Refused, tag_field="type", tag="image"):
    pass


class DocumentBlockParam(_Refused, tag_field="type", tag="document"):
    pass


class SearchResultBlockParam(_Refused, tag_field="type", tag="search_result"):
    pass


class ThinkingBlockParam(_Input, tag_field="type", tag="thinking"):
    """Echoed in an assistant message: skipped, for a model that thinks (the conversation's chain keeps the
    reasoning as generated); refused for one that does not."""

    thinking: Text
    signature: str
    cache_control: CacheControl | None = None


class RedactedThinkingBlockParam(_Input, tag_field="type", tag="redacted_thinking"):
    data: str
    cache_control: CacheControl | None = None


class ToolUseBlockParam(_Input, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # accepted, no effect: every call here is the model's own
    toolset_name: str | None = None  # accepted, no effect: tools are named alone


ToolResultContent = list[TextBlockParam | ImageBlockParam | DocumentBlockParam | SearchResultBlockParam]


class ToolResultBlockParam(_Input, tag_field="type", tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1, max_length=256)]
    content: Text | ToolResultContent | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None  # accepted, no effect


ContentBlockParam = (TextBlockParam | ImageBlockParam | DocumentBlockParam | SearchResultBlockParam | ToolUseBlockParam
                     | ToolResultBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam)


class MessageParam(_Input):
    role: Literal["user", "assistant", "system"]  # system: only opening the conversation (after ``system``)
    content: Text | list[ContentBlockParam]


# --- tools -----------------------------------------------------------------------------------------------
class ToolParam(_Input):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # accepted, no effect: every tool is rendered in the prompt and called by the model directly; a forced call
    # follows input_schema with strict or not, a free one is not constrained; inputs are sent whole
    strict: bool | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ToolChoiceAuto(_Input, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None  # accepted, no effect: auto decoding is unconstrained


class ToolChoiceAny(_Input, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None  # true: exactly one call


class ToolChoiceTool(_Input, tag_field="type", tag="tool"):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    disable_parallel_tool_use: bool | None = None  # one call either way


class ToolChoiceNone(_Input, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# --- the rest of the request -------------------------------------------------------------------------------
class Metadata(_Input):
    # the session key of implicit chains (agentrt.implicit_chains); stored only as a hash
    user_id: Annotated[str, Meta(max_length=512)] | None = None


# a model that thinks (agentrt.reasoning): the chat template's enable_thinking (enabled: true, disabled: false,
# adaptive: the template's default); no effect on one that does not
class ThinkingEnabled(_Input, tag_field="type", tag="enabled"):
    budget_tokens: Annotated[int, Meta(ge=0)]  # no effect: thinking ends when the model closes its block
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks carry no text
    block_binding: dict[str, Any] | None = None  # no effect: thinking blocks sent back are never checked


class ThinkingDisabled(_Input, tag_field="type", tag="disabled"):
    pass


class ThinkingBetweenTools(ThinkingDisabled, tag="between_tools"):
    """Thinking off, as ``disabled`` (a subclass, so it is taken as one): the progress notes Anthropic's models
    write between tool calls are text here."""


class ThinkingAdaptive(_Input, tag_field="type", tag="adaptive"):
    display: Literal["summarized", "omitted"] | None = None
    block_binding: dict[str, Any] | None = None


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingBetweenTools | ThinkingAdaptive


class InputTokens(_Input, tag_field="type", tag="input_tokens"):
    value: Annotated[int, Meta(ge=0)]


class ToolUses(_Input, tag_field="type", tag="tool_uses"):
    value: Annotated[int, Meta(ge=0)]


class ClearToolUsesEdit(_Input, tag_field="type", tag="clear_tool_uses_20250919"):
    trigger: InputTokens | ToolUses | None = None  # default: more than 100,000 input tokens
    keep: ToolUses | None = None  # default: the 3 most recent tool uses
    clear_at_least: InputTokens | None = None
    exclude_tools: list[Annotated[str, Meta(min_length=1, max_length=256)]] | None = None
    # true: the cleared tool uses' inputs (their tool_use arguments) leave the KV with their results; a list:
    # only those of the tools named
    clear_tool_inputs: bool | list[Annotated[str, Meta(min_length=1, max_length=256)]] | None = None


class ThinkingTurns(_Input, tag_field="type", tag="thinking_turns"):
    value: Annotated[int, Meta(ge=0)]


class ClearThinkingEdit(_Input, tag_field="type", tag="clear_thinking_20251015"):
    """The think blocks of all but the last ``keep`` assistant turns that have one leave the chain's KV (a prune:
    agentrt.clear_thinking); ``"all"`` keeps them; none: keep 1, as Anthropic's default."""

    keep: ThinkingTurns | Literal["all"] | None = None


class CompactEdit(_Input, tag_field="type", tag="compact_20260112"):
    """Accepted, no effect: nothing is summarized; the chain keeps the conversation (clear_tool_uses_20250919
    frees its KV instead)."""

    trigger: InputTokens | None = None
    instructions: str | None = None
    pause_after_compaction: bool | None = None


class ContextManagement(_Input):
    edits: list[ClearToolUsesEdit | ClearThinkingEdit | CompactEdit] = field(default_factory=list)


class JSONOutputFormat(_Input, tag_field="type", tag="json_schema"):
    """Structured outputs: the reply's text is JSON that validates against ``schema`` (docs/structured-outputs.md)."""

    schema: dict[str, Any]


class OutputConfig(_Input):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect: see `thinking`
    format: JSONOutputFormat | None = None
    task_budget: dict[str, Any] | None = None  # no effect


class Compaction(Struct, kw_only=True):
    """Refused on /v1/messages (count_tokens ignores it, as Anthropic's does): a 400 naming ``compaction``."""

    def __post_init__(self) -> None:
        raise ValueError("no compaction blocks are made here: send the conversation as it is (its chain keeps "
                         "the KV; context_management clear_tool_uses_20250919 frees it)")


class Thread(Struct, kw_only=True):
    """Refused: any value but null is a 400 naming ``thread``."""

    def __post_init__(self) -> None:
        raise ValueError("server-held threads are not kept here: send the whole conversation every time (its chain "
                         "is resumed, only the new messages are computed)")


ForcedTokenIds = Annotated[list[Annotated[int, Meta(ge=0, le=2**31)]], Meta(max_length=65536)]


class MessagesRequest(_Input):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[MessageParam], Meta(min_length=1, max_length=100_000)]
    system: Text | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's default: 1.0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    thinking: Thinking | None = None  # a thinking model's enable_thinking (above); no effect on another
    context_management: ContextManagement | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, no effect: one tier
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    # accepted, no effect: one model, one region, one speed, nothing billed, no diagnostics
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    fallbacks: list[dict[str, Any]] | Literal["default"] | None = None  # the model never declines for policy
    fallback_credit_token: str | dict[str, Any] | None = None
    billing_policy: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    # refused
    container: Any = None  # no code-execution containers here
    mcp_servers: list[dict[str, Any]] | None = None  # unless empty: this server connects to none
    compaction: Compaction | None = None
    thread: Thread | None = None
    # test extension: the first generated tokens, forced (the chain routes' ``sampling.forced_token_ids``)
    agentrt_forced_token_ids: ForcedTokenIds | None = None


class CountTokensRequest(_Input):
    model: str
    messages: Annotated[list[MessageParam], Meta(min_length=1, max_length=100_000)]
    system: Text | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # accepted, no effect (compaction too: Anthropic's count_tokens ignores it)
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None
    billing_policy: dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None


# --- the response ----------------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(Struct, kw_only=True, tag_field="type", tag="text"):
    text: str
    citations: None = None


class ThinkingBlock(Struct, kw_only=True, tag_field="type", tag="thinking"):
    """A thinking model's think block (agentrt.reasoning), before the text. ``signature`` is a constant
    (agentrt.anthropic_events.THINKING_SIGNATURE): nothing is verified when a client sends the block back."""

    thinking: str
    signature: str


class ToolUseBlock(Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class Usage(Struct, kw_only=True):
    input_tokens: int  # prompt tokens this request computed (prefilled)
    output_tokens: int
    cache_creation_input_tokens: int = 0  # always 0: a chain's KV costs nothing extra to keep
    cache_read_input_tokens: int = 0  # prompt tokens reused: resumed from the chain or prefix-cached


class ClearToolUsesApplied(Struct, kw_only=True, tag_field="type", tag="clear_tool_uses_20250919"):
    cleared_tool_uses: int
    cleared_input_tokens: int


class ClearThinkingApplied(Struct, kw_only=True, tag_field="type", tag="clear_thinking_20251015"):
    cleared_thinking_turns: int
    cleared_input_tokens: int


class ContextManagementResponse(Struct, kw_only=True):
    applied_edits: list[ClearToolUsesApplied | ClearThinkingApplied]


class Message(Struct, kw_only=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    context_management: ContextManagementResponse | UnsetType = UNSET  # with a request's context_management


class CountTokensContextManagement(Struct, kw_only=True):
    original_input_tokens: int


class CountTokensResponse(Struct, kw_only=True):
    input_tokens: int
    context_management: CountTokensContextManagement | UnsetType = UNSET


# --- stream events (``event: <type>``, the data carries the same ``type``) ------------------------------------
class MessageStartEvent(Struct, kw_only=True, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStartEvent(Struct, kw_only=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class InputJSONDelta(Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(Struct, kw_only=True, tag_field="type", tag="signature_delta"):
    signature: str


class ContentBlockDeltaEvent(Struct, kw_only=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJSONDelta | ThinkingDelta | SignatureDelta


class ContentBlockStopEvent(Struct, kw_only=True, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDelta(Struct, kw_only=True):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaEvent(Struct, kw_only=True, tag_field="type", tag="message_delta"):
    delta: MessageDelta
    usage: Usage  # the totals (Anthropic's clients take message_delta's counts over message_start's)
    context_management: ContextManagementResponse | UnsetType = UNSET


class MessageStopEvent(Struct, kw_only=True, tag_field="type", tag="message_stop"):
    pass


# --- errors ---------------------------------------------------------------------------------------------------
ErrorType = Literal["invalid_request_error", "authentication_error", "billing_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "timeout_error", "api_error",
                    "overloaded_error"]


class ErrorObject(Struct, kw_only=True):
    type: ErrorType
    message: str


class ErrorResponse(Struct, kw_only=True, tag_field="type", tag="error"):
    """Every error on these routes, and the data of an ``error`` event in a started stream."""

    error: ErrorObject


StreamEvent = (MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
               | MessageDeltaEvent | MessageStopEvent | ErrorResponse)
