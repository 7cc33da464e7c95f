"""The OpenAI chat-completions wire types the compatible route reads and writes.

Unlike agentrt's own API, requests tolerate unknown fields (OpenAI clients send many optional knobs); the
fields declared here are validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from sdk.schema import FunctionCall, ToolCall


class ContentPart(Struct, kw_only=True):
    type: Literal["text"]
    text: str


Content = str | list[ContentPart]


class _Message(Struct, tag_field="role", kw_only=True):
    name: str | None = None


class SystemMessage(_Message, kw_only=True, tag="system"):
    content: Content


class DeveloperMessage(_Message, kw_only=True, tag="developer"):
    content: Content


class UserMessage(_Message, kw_only=True, tag="user"):
    content: Content


class AssistantMessageIn(_Message, kw_only=True, tag="assistant"):
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message, kw_only=True, tag="tool"):
    content: Content
    tool_call_id: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessageIn | ToolMessage


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Any = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    chain_id: Annotated[str, Meta(min_length=1, max_length=64)] | None = None  # agentrt extension: resume a chain
    forced_token_ids: list[Annotated[int, Meta(ge=0, le=2**31)]] | None = None  # agentrt extension (replays)


class ChatMessage(Struct, kw_only=True):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | None = None


class Choice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: None = None


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
    resume_status: Literal["created", "resumed", "recomputed"]


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
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


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
