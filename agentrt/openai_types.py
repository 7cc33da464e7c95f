"""The OpenAI chat-completions wire types the compatible route reads and writes.

Requests forbid unknown fields, as OpenAI does: a field that is neither OpenAI's nor one of agentrt's extensions
(``chain_id``, ``forced_token_ids``, ``top_k``, ``min_p``, ``chat_template_kwargs``, ``session_hints``) is a 400
naming it. Every
field of OpenAI's request is declared; those this server cannot honor are refused by ``agentrt.completions`` with a
400 naming them (docs/server.md lists each field and what it does here).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from sdk.schema import FunctionCall, ToolCall, TurnHints


class _Strict(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TextPart(_Strict, tag_field="type", tag="text", kw_only=True):
    text: str
    prompt_cache_breakpoint: Any = None  # no effect: prefix caching here is automatic


# image, audio and file parts are refused by type (agentrt.completions_input): decoded whole, so that the 400 names it
class ImagePart(_Strict, tag_field="type", tag="image_url", kw_only=True):
    image_url: Any = None
    prompt_cache_breakpoint: Any = None


class AudioPart(_Strict, tag_field="type", tag="input_audio", kw_only=True):
    input_audio: Any = None
    prompt_cache_breakpoint: Any = None


class FilePart(_Strict, tag_field="type", tag="file", kw_only=True):
    file: Any = None
    prompt_cache_breakpoint: Any = None


class RefusalPart(_Strict, tag_field="type", tag="refusal", kw_only=True):
    refusal: str


ContentPart = TextPart | ImagePart | AudioPart | FilePart | RefusalPart
Content = str | list[ContentPart]


class _Message(_Strict, tag_field="role", kw_only=True):
    name: str | None = None


class SystemMessage(_Message, tag="system", kw_only=True):
    content: Content


class DeveloperMessage(_Message, tag="developer", kw_only=True):
    content: Content


class UserMessage(_Message, tag="user", kw_only=True):
    content: Content


class AssistantMessageIn(_Message, tag="assistant", kw_only=True):
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    # what a client echoes back of a response message (``message.model_dump()``): null, or ignored
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None  # a thinking model's reasoning, echoed: not rendered (the chain keeps it)
    reasoning: str | None = None  # the same, as some clients name it


class ToolMessage(_Message, tag="tool", kw_only=True):
    content: Content
    tool_call_id: str


class FunctionMessage(_Message, tag="function", kw_only=True):
    """Deprecated by OpenAI (tool messages replace it); refused with a pointer to ``tool``."""

    content: str | None = None


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessageIn | ToolMessage | FunctionMessage


class FunctionDef(_Strict, omit_defaults=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # with tool_choice "auto": calls of this tool follow `parameters` (a grammar)


class Tool(_Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no effect: chunks are not padded


class ChatTemplateKwargs(_Strict, kw_only=True):
    """vLLM's and SGLang's ``chat_template_kwargs``: ``enable_thinking`` (agentrt.reasoning) and
    ``preserve_thinking`` (templates that drop earlier replies' reasoning keep it: Qwen3.6's), passed to the chat
    template; a template that does not know one ignores it."""

    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None


Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)] | None


class ChatCompletionRequest(_Strict, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    # honored
    tools: list[Tool] | None = None
    # "none", "auto", "required", {"type": "function", "function": {"name": ...}}: agentrt.structured_spec
    tool_choice: str | dict[str, Any] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # 0: the most likely token only (greedy)
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    n: Annotated[int, Meta(ge=1)] | None = None  # 1 only
    stream: bool | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most under tool_choice "required"
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (sdk.schema.ResponseFormat)
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # accepted with no effect here
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # accepted only at their neutral value
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None  # a thinking model: "none" is thinking off, any other level on
    verbosity: str | None = None
    # refused unless null
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    # agentrt extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    chain_id: Annotated[str, Meta(min_length=1, max_length=64)] | None = None  # resume a chain
    forced_token_ids: list[Annotated[int, Meta(ge=0, le=2**31)]] | None = None  # emitted first (replays, tests)
    chat_template_kwargs: ChatTemplateKwargs | None = None  # {"enable_thinking": bool}, as vLLM and SGLang take it
    session_hints: TurnHints | None = None  # for the chain the turn runs on (sdk.schema.TurnHints)


class ChatMessage(Struct, kw_only=True):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | UnsetType = UNSET  # a thinking model's reasoning (vLLM's and SGLang's field)


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, kw_only=True):
    """One entry per generated token (tool-call markup and a stop token included)."""

    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class CompletionUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    object: Literal["chat.completion"] = "chat.completion"


class ChainTurn(Struct, kw_only=True):
    """With ``chain_id``: the turn the request appended to the chain."""

    id: str
    turn: int
    resume_status: Literal["created", "resumed", "recomputed", "loaded"]


class ChainCompletion(ChatCompletion, kw_only=True):
    chain: ChainTurn


class ToolCallDelta(Struct, kw_only=True):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None  # with ``logprobs``: the tokens this chunk's engine step generated


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ChainCompletionChunk(ChatCompletionChunk, kw_only=True):
    """The chunk with the finish reason, with ``chain_id``."""

    chain: ChainTurn


class ModelCard(Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "agentrt"
    object: Literal["model"] = "model"


class ModelList(Struct, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorObject(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None  # the offending request field (``messages[0].role``)
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    """OpenAI's error body, on the OpenAI-compatible routes (also as the ``data`` of an SSE event mid-stream)."""

    error: ErrorObject


# --- the legacy text completions route (POST /v1/completions: agentrt.text_completions) ---------------------
TokenId = Annotated[int, Meta(ge=0, le=2**31)]
PromptText = Annotated[str, Meta(min_length=1)]
# a string, a list of token ids, or a batch: a list of strings or a list of token-id lists (a mix is a 400)
Prompt = PromptText | Annotated[list[PromptText | TokenId | Annotated[list[TokenId], Meta(min_length=1)]],
                                Meta(min_length=1)]


class TextCompletionRequest(_Strict, kw_only=True):
    """OpenAI's ``POST /v1/completions`` body; docs/server.md ("Text completions") says what each field does."""

    model: str
    prompt: Prompt
    max_tokens: Annotated[int, Meta(ge=1)] | None = None  # OpenAI's default: 16
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # 0: the most likely token only (greedy)
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    stop: Annotated[str, Meta(min_length=1)] | list[Annotated[str, Meta(min_length=1)]] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # the K most likely tokens at each position
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, no effect: a stateless request
    # accepted only at their neutral value
    best_of: Annotated[int, Meta(ge=1, le=128)] | None = None  # null or n
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    suffix: str | None = None  # null or "": no insertion mode here
    # agentrt extensions (``ignore_eos`` and ``repetition_penalty`` as vLLM's benchmark clients send them)
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None  # null or 1.0 only
    forced_token_ids: list[TokenId] | None = None  # emitted first (replays, tests)


class TextLogprobs(Struct, kw_only=True):
    """The legacy form: per generated token its text, its log-probability, the ``logprobs`` most likely tokens at
    its position (the sampled one added when it is not among them) and its character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(Struct, kw_only=True):
    text: str
    index: int
    logprobs: TextLogprobs | None
    finish_reason: Literal["stop", "length"] | None  # null in a stream's chunks but each choice's last


class TextCompletion(Struct, kw_only=True):
    """The response, and each chunk of a stream (the usage chunk with ``include_usage`` has no choices)."""

    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage | None
    object: Literal["text_completion"] = "text_completion"
