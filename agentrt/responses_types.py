"""OpenAI's Responses API (``/v1/responses``): the request and the response object (docs/responses.md).

Unknown fields are refused (400 naming them); the documented fields are accepted. ``prompt_cache_key`` (else
``user``, else ``safety_identifier``) scopes the implicit chain a request without ``previous_response_id`` resumes.
Fields that have no effect here: ``service_tier``, ``truncation`` ("disabled" only), ``include``,
``max_tool_calls``, ``reasoning`` (but ``reasoning.effort`` for a model that thinks: "none" is thinking off, another
level on), ``stream_options``, ``text.verbosity``, ``prompt_cache_options``, ``prompt_cache_retention``,
``context_management``, ``access_programs``, ``background_options``, ``image``, ``tools[].strict`` and
``tools[].description`` beyond the rendered prompt (a forced call follows the schema either way), and the items'
and tools' fields of OpenAI's tool search and programmatic tool calling (``caller``, ``namespace``, ``async``,
``defer_loading``, ``allowed_callers``, ``output_schema``).
Refused when set: ``background: true``, ``prompt``, ``top_logprobs``, ``moderation``, non-function tools,
``truncation: "auto"``.
``conversation`` (an id, or ``{"id": ...}``): the response is the conversation's next turn (agentrt.conversations).

Input items are taken as raw objects and checked one by one (agentrt.responses) so that an error names the
item (``input[2].call_id``); their typed forms are below. Their no-effect fields default to UNSET, so that a stored
item lists only what the client sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType, field

from sdk.schema import TurnHints


class _In(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# --- the request ---------------------------------------------------------------------------------------------
class InputText(_In, tag_field="type", tag="input_text"):
    text: str
    prompt_cache_breakpoint: Any = UNSET  # no effect: prefix caching here is automatic


class OutputText(_In, tag_field="type", tag="output_text"):  # an echoed assistant message's text
    text: str
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageItem(_In, tag_field="type", tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None | UnsetType = UNSET  # no effect: an assistant message's label


class FunctionCallItem(_In, tag_field="type", tag="function_call"):  # echoed from a previous output
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # no effect: what OpenAI's programmatic and namespaced tool calling label a call with
    caller: dict[str, Any] | None | UnsetType = UNSET
    namespace: str | None | UnsetType = UNSET
    async_: bool | None | UnsetType = field(default=UNSET, name="async")


class FunctionCallOutputItem(_In, tag_field="type", tag="function_call_output"):
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None
    # no effect: the tool message is named after the function_call it answers
    name: str | None | UnsetType = UNSET
    caller: dict[str, Any] | None | UnsetType = UNSET
    namespace: str | None | UnsetType = UNSET


class ReasoningItem(_In, tag_field="type", tag="reasoning"):  # echoed from a previous output: skipped
    id: str | None = None
    summary: list[Any] = field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_In, tag_field="type", tag="function"):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # no effect: a forced call follows the schema either way
    description: str | None = None
    # no effect: every tool is in the prompt from the start and called directly; outputs are not checked
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None
    async_: bool | None = field(default=None, name="async")


class ToolChoiceFunction(_In):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class FormatText(_In, tag_field="type", tag="text"):
    pass


class FormatJsonObject(_In, tag_field="type", tag="json_object"):
    pass


class FormatJsonSchema(_In, tag_field="type", tag="json_schema"):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(_In):
    format: FormatText | FormatJsonObject | FormatJsonSchema | None = None
    verbosity: str | None = None  # no effect


class ConversationParam(_In):
    id: str


class ContextManagement(_In):  # OpenAI's server-side compaction: no effect, the chain keeps the conversation whole
    type: str
    compact_threshold: int | None = None


class Moderation(Struct, kw_only=True):
    """Refused: any value but null is a 400 naming ``moderation``."""

    def __post_init__(self) -> None:
        raise ValueError("this server runs no moderation: leave it out")


class ResponsesRequest(_In):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (checked one by one: FunctionTool)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    store: bool | None = None  # default true
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None
    # the session key of implicit chains (the first given of prompt_cache_key, user, safety_identifier;
    # agentrt.implicit_chains), read without previous_response_id
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    session_hints: TurnHints | None = None  # agentrt extension: for the response's chain (sdk.schema.TurnHints)
    # accepted, no effect
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None  # ``effort``: a thinking model's on ("none": off) / off switch
    stream_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None  # prefix caching here is automatic, keyed by the tokens
    prompt_cache_retention: str | None = None
    context_management: list[ContextManagement] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None  # its windows need `background`, which is refused
    image: dict[str, Any] | None = None  # the model takes no images
    conversation: str | ConversationParam | None = None  # not with previous_response_id
    # refused when set
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    moderation: Moderation | None = None
    # agentrt extension: the first generated tokens, forced (the chain routes' ``sampling.forced_token_ids``)
    forced_token_ids: Annotated[list[Annotated[int, Meta(ge=0, le=2**31)]], Meta(max_length=65536)] | None = None


# --- the response ----------------------------------------------------------------------------------------------
class OutputTextPart(Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class OutputMessage(Struct, kw_only=True):
    id: str
    content: list[OutputTextPart]
    type: str = "message"
    role: str = "assistant"
    status: str = "completed"


class OutputFunctionCall(Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    status: str = "completed"


class ReasoningTextPart(Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class OutputReasoning(Struct, kw_only=True):
    """A thinking model's think block (agentrt.reasoning), before the message."""

    id: str
    content: list[ReasoningTextPart]
    summary: list[Any] = field(default_factory=list)  # always empty: no summaries are made
    type: str = "reasoning"
    status: str = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: str


class ResponseConversation(Struct, kw_only=True):
    id: str


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[Any]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    metadata: dict[str, str]
    text: dict[str, Any]
    store: bool
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    truncation: str = "disabled"
    conversation: ResponseConversation | None = None  # the conversation the response is a turn of
    object: str = "response"


class InputItemList(Struct, kw_only=True):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class ResponseDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: str = "response.deleted"
