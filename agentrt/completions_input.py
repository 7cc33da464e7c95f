"""An OpenAI completion request in the engine's and the chain routes' terms (agentrt.completions,
agentrt.text_completions): what is refused (a 400 naming the field, as OpenAI would), the sampling knobs, the
``forced_token_ids`` extension, the chat template's thinking flags and its messages.

``reasoning_effort`` ("none": off, any other level: on) and ``chat_template_kwargs.enable_thinking`` (which wins)
become the chat template's ``enable_thinking``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrt.chain_completions import text_of
from agentrt.chat import Message
from agentrt.errors import bad_field
from agentrt.openai_types import (AssistantMessageIn, ChatCompletionRequest, DeveloperMessage, FunctionMessage,
                                  RefusalPart, TextPart, ToolMessage)
from agentrt.openai_types import Message as OpenAIMessage

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's; "none" is off


def check_supported(req: ChatCompletionRequest, thinks: bool = False) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do as OpenAI would (docs/server.md has
    the table of every request field). ``thinks``: the model thinks (agentrt.reasoning), so
    ``reasoning_effort`` may turn its thinking on or off."""
    def refuse(key: str, why: str, code: str = "unsupported_parameter") -> None:
        raise bad_field(key, why, code)

    if req.functions is not None:
        refuse("functions", "deprecated by OpenAI and not supported: declare functions as `tools` "
                            '([{"type": "function", "function": {...}}])')
    if req.function_call is not None:
        refuse("function_call", "deprecated by OpenAI and not supported: use `tool_choice` with `tools`")
    if req.n is not None and req.n != 1:
        refuse("n", "only one choice per request is generated here (n = 1)", "unsupported_value")
    for key in ("frequency_penalty", "presence_penalty"):
        if getattr(req, key):
            refuse(key, "must be 0 or left out: the engine applies no penalties", "unsupported_value")
    if req.logit_bias:
        refuse("logit_bias", "must be empty or left out: the engine applies no logit bias", "unsupported_value")
    if req.modalities is not None and req.modalities != ["text"]:
        refuse("modalities", 'only ["text"]: this model generates text', "unsupported_value")
    if req.audio is not None:
        refuse("audio", "this model generates text only")
    # a model that does not think takes any level with no effect (agent clients send their configured effort)
    if req.reasoning_effort not in (None, *REASONING_EFFORTS):
        refuse("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)} (\"none\": no thinking; any "
                                   "other level turns thinking on)", "invalid_value")
    if req.web_search_options is not None:
        refuse("web_search_options", "this server does not search the web")
    if req.moderation is not None:
        refuse("moderation", "this server runs no moderation")
    if req.top_logprobs and not req.logprobs:
        refuse("top_logprobs", "requires `logprobs: true`", "invalid_value")
    for i, m in enumerate(req.messages):
        if isinstance(m, FunctionMessage):
            refuse(f"messages[{i}].role", "role 'function' is deprecated by OpenAI and not supported: send a "
                                          "tool's result as a 'tool' message with its tool_call_id", "invalid_value")
        if isinstance(m, AssistantMessageIn):
            if m.function_call is not None:
                refuse(f"messages[{i}].function_call", "deprecated by OpenAI and not supported: use tool_calls")
            if m.audio is not None:
                refuse(f"messages[{i}].audio", "this model takes text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if not isinstance(part, (TextPart, RefusalPart)) or (isinstance(part, RefusalPart)
                                                                      and not isinstance(m, AssistantMessageIn)):
                    refuse(f"messages[{i}].content[{j}].type",
                           f"this model takes text only, not {part.__struct_config__.tag!r} parts", "invalid_value")


def sampling_knobs(req: Any) -> dict[str, Any]:
    """temperature, top_p, top_k and min_p of an OpenAI request (chat or text completion) for the engine:
    ``top_p`` 0 means greedy (a nucleus of one token), since the engine takes top_p in (0, 1]."""
    greedy = req.top_p == 0
    return dict(temperature=0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None or greedy else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p)


def checked_forced_tokens(forced: list[int] | None, max_tokens: int, vocab: int) -> list[int]:
    """The ``forced_token_ids`` extension, checked against the turn's token budget and the vocabulary."""
    forced = list(forced or [])
    if len(forced) > max_tokens:
        raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_tokens ({max_tokens})")
    if any(t >= vocab for t in forced):
        raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
    return forced


def enable_thinking(req: ChatCompletionRequest) -> bool | None:
    """The chat template's ``enable_thinking`` for the request (None: the template's default):
    ``chat_template_kwargs.enable_thinking``, else ``reasoning_effort`` ("none": False, another level: True)."""
    if req.chat_template_kwargs is not None and req.chat_template_kwargs.enable_thinking is not None:
        return req.chat_template_kwargs.enable_thinking
    return None if req.reasoning_effort is None else req.reasoning_effort != "none"


def preserve_thinking(req: ChatCompletionRequest) -> bool | None:
    """``chat_template_kwargs.preserve_thinking``, for templates that would drop earlier replies' reasoning."""
    return None if req.chat_template_kwargs is None else req.chat_template_kwargs.preserve_thinking


def template_message(m: OpenAIMessage) -> Message:
    role = "system" if isinstance(m, DeveloperMessage) else str(m.__struct_config__.tag)
    out: Message = {"role": role, "content": text_of(m.content)}
    if isinstance(m, AssistantMessageIn) and m.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(m.tool_calls)
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
    return out


def include_usage(req: ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
