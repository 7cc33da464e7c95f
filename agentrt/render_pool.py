"""Chat-template rendering and tokenization off the event loop, after a size check.

Rendering a turn runs the chat template once per new message (agentrt.chat.ChatRenderer.append) and tokenizes
the result: seconds of CPU for a body of megabytes. On the event loop that stalls every other client, so it
runs on a small pool of worker threads (the event loop keeps its share of the interpreter between them).
Before any of it, the request's messages (and tools) are measured as the JSON they arrived as: more
characters than ``chars_per_token`` times the model's context cannot fit it whatever the tokenizer does with
them, and are a 413 naming ``messages`` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec
from litestar.exceptions import HTTPException

from agentrt.chat import Appended, ChatRenderer, Message
from agentrt.tool_syntax import ToolCallReader

T = TypeVar("T")


class PromptTooLarge(HTTPException):
    status_code = 413

    def __init__(self, chars: int, limit: int, max_model_len: int):
        message = (f"the messages hold {chars} characters as JSON, more than this server takes at once ({limit}: "
                   f"{limit // max_model_len} per token of the model's {max_model_len}-token context)")
        super().__init__(detail=f"messages: {message}", extra=[{"message": message, "key": "messages",
                                                               "source": "body"}])


class RenderPool:
    def __init__(self, renderer: ChatRenderer, max_model_len: int, workers: int = 2, chars_per_token: int = 32):
        self.renderer = renderer
        self.max_model_len = max_model_len
        self.max_chars = chars_per_token * max_model_len
        self._limiter = anyio.CapacityLimiter(workers)

    def reader(self, tools: Any = None) -> ToolCallReader:
        """Tool calls in the model's syntax under ``tools`` (OpenAI tool dicts)."""
        return ToolCallReader(self.renderer.tool_syntax, tools)

    def check_size(self, *parts: Any) -> None:
        """PromptTooLarge when ``parts`` (messages, tools) encode to more JSON than ``max_chars``."""
        chars = sum(len(msgspec.json.encode(p)) for p in parts if p)
        if chars > self.max_chars:
            raise PromptTooLarge(chars, self.max_chars, self.max_model_len)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def append(self, history: list[Message], new: list[Message], tools: list[dict] | None,
                     last_token: int | None = None, assistant_prefix: str | None = None,
                     log_ids: Sequence[int] | None = None) -> Appended:
        self.check_size(new, tools, assistant_prefix)
        return await self._run(self.renderer.append, history, new, tools, last_token, assistant_prefix, log_ids)

    async def prompt(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        self.check_size(messages, tools)
        return await self._run(self.renderer.prompt, messages, tools)

    async def render(self, messages: list[Message], tools: list[dict] | None) -> str:
        self.check_size(messages, tools)
        return await self._run(self.renderer.render, messages, tools)
