"""A small agent loop: register Python callables as tools; ``run`` answers the assistant's tool calls with
tool-result messages until it answers without calls (or ``max_rounds`` tool rounds were sent)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sdk._base import tool_result
from sdk.schema import (AssistantMessage, FunctionDef, Sampling, Tool, ToolCall, ToolResultMessage, TurnResult,
                        UserMessage)

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
Prefix = str | Callable[[int], str | None] | None


@dataclass
class Transcript:
    """What a run sent and received, in order; ``finished`` is False when ``max_rounds`` stopped it."""

    messages: list[UserMessage | AssistantMessage | ToolResultMessage] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)
    finished: bool = False

    @property
    def final(self) -> AssistantMessage | None:
        return self.turns[-1].message if self.turns else None


class Agent:
    """``agent = Agent(); @agent.tool def get_weather(city: str): ...``; pass ``agent.tools()`` to
    ``chains.create(tools=...)``, then ``agent.run(chain, "Weather in Paris?")``."""

    def __init__(self, tools: Mapping[str, Callable[..., Any]] | None = None):
        self._fns: dict[str, Callable[..., Any]] = {}
        self._defs: dict[str, Tool] = {}
        for name, fn in (tools or {}).items():
            self.register(fn, name=name)

    def register(self, fn: Callable[..., Any], name: str | None = None, description: str | None = None,
                 parameters: dict[str, Any] | None = None) -> Callable[..., Any]:
        name = name or fn.__name__
        self._fns[name] = fn
        self._defs[name] = Tool(function=FunctionDef(
            name=name, description=description or inspect.getdoc(fn),
            parameters=parameters if parameters is not None else _parameters(fn)))
        return fn

    def tool(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
             description: str | None = None, parameters: dict[str, Any] | None = None) -> Any:
        """Decorator, bare (``@agent.tool``) or with options (``@agent.tool(name="search")``)."""
        if fn is not None:
            return self.register(fn, name, description, parameters)
        return lambda f: self.register(f, name, description, parameters)

    def tools(self) -> list[Tool]:
        """The registered tools' definitions, for ``chains.create(tools=...)``."""
        return list(self._defs.values())

    def call(self, call: ToolCall) -> ToolResultMessage:
        """Run one tool call: the JSON arguments become keyword arguments; a non-string result is sent as JSON;
        an unknown tool, bad arguments or an exception become an ``error: ...`` result the model can read."""
        return tool_result(call, self._invoke(call))

    async def acall(self, call: ToolCall) -> ToolResultMessage:
        content = self._invoke(call)
        if inspect.isawaitable(content):
            try:
                content = await content
            except Exception as exc:  # noqa: BLE001 - the model reads the error
                content = f"error: {type(exc).__name__}: {exc}"
        return tool_result(call, content)

    def _invoke(self, call: ToolCall) -> Any:
        fn = self._fns.get(call.function.name)
        if fn is None:
            return f"error: unknown tool {call.function.name!r}"
        try:
            args = json.loads(call.function.arguments or "{}")
            return fn(**args) if isinstance(args, dict) else fn(args)
        except Exception as exc:  # noqa: BLE001 - the model reads the error
            return f"error: {type(exc).__name__}: {exc}"

    def run(self, chain: Any, user_text: str, max_rounds: int = 8, *, assistant_prefix: Prefix = None,
            sampling: Sampling | Mapping[str, Any] | None = None, **sampling_overrides: Any) -> Transcript:
        """Drive a sync ``Chain``. ``assistant_prefix``: a string for the first turn, or ``f(turn_index)``."""
        out, messages = Transcript(), [UserMessage(content=user_text)]
        for index in range(max_rounds + 1):
            out.messages += messages
            result = chain.send(messages, assistant_prefix=_prefix(assistant_prefix, index), sampling=sampling,
                                **sampling_overrides)
            if self._record(out, result) or index == max_rounds:
                break
            messages = [self.call(c) for c in result.message.tool_calls]
        return out

    async def arun(self, chain: Any, user_text: str, max_rounds: int = 8, *, assistant_prefix: Prefix = None,
                   sampling: Sampling | Mapping[str, Any] | None = None, **sampling_overrides: Any) -> Transcript:
        """``run`` for an ``AsyncChain``; tools may be coroutine functions."""
        out, messages = Transcript(), [UserMessage(content=user_text)]
        for index in range(max_rounds + 1):
            out.messages += messages
            result = await chain.send(messages, assistant_prefix=_prefix(assistant_prefix, index),
                                      sampling=sampling, **sampling_overrides)
            if self._record(out, result) or index == max_rounds:
                break
            messages = [await self.acall(c) for c in result.message.tool_calls]
        return out

    @staticmethod
    def _record(out: Transcript, result: TurnResult) -> bool:
        out.turns.append(result)
        out.messages.append(result.message)
        out.finished = not result.message.tool_calls
        return out.finished


def _prefix(prefix: Prefix, index: int) -> str | None:
    if callable(prefix):
        return prefix(index)
    return prefix if index == 0 else None


def _parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema of ``fn``'s keyword parameters from their annotations (unknown types: no type)."""
    props: dict[str, Any] = {}
    required: list[str] = []
    try:
        sig = inspect.signature(fn)
        hints = {k: v for k, v in inspect.get_annotations(fn, eval_str=True).items()}
    except (TypeError, ValueError, NameError):
        return {"type": "object", "properties": {}}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(hints.get(p.name))  # type: ignore[arg-type]
        props[p.name] = {"type": kind} if kind else {}
        if p.default is p.empty:
            required.append(p.name)
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema
