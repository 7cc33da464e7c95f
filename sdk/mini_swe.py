"""mini-swe-agent adapter (``pip install agentrt[swe]``): ``model_class: sdk.mini_swe.AgentrtModel``.

One chain per agent run. Each ``query(messages)`` diffs ``messages`` against what the chain already holds and
sends only the new ones: the system message and the task create the chain, environment observations go as
tool results (regions of kind ``tool_result``, tool ``bash``), other user messages (format errors) as user
messages. A list that does not extend the held one (a new ``agent.run``) starts a new chain. A chain the
server had to recompute (restart, reclaimed KV) is reported in ``extra["agentrt"]["resume_status"]``.

Actions are parsed as mini-swe-agent does: ``actions: text`` (default) with ``action_regex`` over the reply,
``actions: toolcall`` from the tool calls the server parsed (the chain is given mini-swe-agent's bash tool).
The cost is 0.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec
from minisweagent.exceptions import FormatError
from minisweagent.models import GLOBAL_MODEL_STATS
from minisweagent.models.utils.actions_text import format_observation_messages, parse_regex_actions
from minisweagent.models.utils.actions_toolcall import (BASH_TOOL, format_toolcall_observation_messages,
                                                        parse_toolcall_actions)
from minisweagent.models.utils.openai_multimodal import expand_multimodal_content
from pydantic import BaseModel, Field

from sdk.client import Chain, Client
from sdk.schema import ToolResultMessage, TurnResult, UserMessage

log = logging.getLogger(__name__)
SendOptions = Callable[[int, list[UserMessage | ToolResultMessage]], Mapping[str, Any]]


class HistoryError(ValueError):
    """The agent's messages cannot be sent to a chain (the message says which and why)."""


class AgentrtModelConfig(BaseModel):
    model_name: str = "agentrt"
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = Field(default_factory=lambda: os.getenv("AGENTRT_API_KEY"))
    timeout: float = 300.0
    max_retries: int = 3
    sampling: dict[str, Any] = {}
    """Sampling fields of every turn (``max_tokens``, ``temperature``, ``stop``, ...)."""
    chain: dict[str, Any] = {}
    """Extra ``chains.create`` arguments: ``prune_policy``, ``method``, ``method_config``, ``metadata``, ``model``."""
    actions: Literal["text", "toolcall"] = "text"
    action_regex: str = r"```mswea_bash_command\s*\n(.*?)\n```"
    tool_name: str = "bash"
    """The tool name observations are tagged with (text mode)."""
    format_error_template: str = (
        "Please always provide EXACTLY ONE action in triple backticks, found {{actions|length}} actions.")
    observation_template: str = (
        "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
        "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>")
    multimodal_regex: str = ""


class AgentrtModel:
    """A mini-swe-agent Model over an agentrt chain. ``client`` (a ``sdk.Client``) and ``send_options``
    (``f(turn, new_messages) -> extra Chain.send keywords``, e.g. forced tokens in tests) are for Python use."""

    def __init__(self, *, client: Client | None = None, send_options: SendOptions | None = None, **kwargs: Any):
        self.config = AgentrtModelConfig(**kwargs)
        self.client = client or Client(self.config.base_url, api_key=self.config.api_key,
                                       timeout=self.config.timeout, max_retries=self.config.max_retries)
        self.send_options = send_options
        self.chain: Chain | None = None
        self.chain_ids: list[str] = []
        self.num_turns = 0  # turns of the current chain
        self.num_recomputed = 0
        self._held: list[tuple[str, str]] = []  # the agent-visible messages the chain holds, as (role, content)

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        messages = [m for m in messages if m.get("role") != "exit"]
        keys = [_key(m) for m in messages]
        held = len(self._held)
        is_new = self.chain is None or len(keys) <= held or keys[:held] != self._held
        if is_new:
            _check_start(messages)
        turn, start = (0, 1) if is_new else (self.num_turns, held)
        wire = [self._wire(m, f"{self.config.tool_name}-{turn}-{i}") for i, m in enumerate(messages[start:])]
        if is_new:
            self._new_chain(_text(messages[0]))
            self._held, self.num_turns = keys[:1], 0
        options = dict(self.send_options(turn, wire)) if self.send_options else {}
        result = self.chain.send(wire, sampling={**self.config.sampling, **kwargs}, **options)
        self._held, self.num_turns = keys, result.turn + 1
        return self._message(result)

    def _new_chain(self, system_prompt: str) -> None:
        tools = [BASH_TOOL] if self.config.actions == "toolcall" else None
        self.chain = self.client.chains.create(system_prompt=system_prompt, tools=tools, **self.config.chain)
        self.chain_ids.append(self.chain.id)

    def _wire(self, message: dict[str, Any], call_id: str) -> UserMessage | ToolResultMessage:
        role, text = message.get("role"), _text(message)
        if role == "tool":
            return ToolResultMessage(content=text, tool_call_id=message["tool_call_id"])
        if role == "user" and "returncode" in (message.get("extra") or {}):  # an environment observation
            return ToolResultMessage(content=text, tool_call_id=call_id, name=self.config.tool_name)
        if role == "user":
            return UserMessage(content=text)
        raise HistoryError(f"cannot send a {role!r} message to a chain (only user and tool messages are appended; "
                           "assistant messages are the chain's own replies)")

    def _message(self, result: TurnResult) -> dict[str, Any]:
        if result.resume_status == "recomputed":
            self.num_recomputed += 1
            log.info("chain %s was recomputed from its token log at turn %d", result.chain_id, result.turn)
        GLOBAL_MODEL_STATS.add(0.0)
        content = result.message.content
        info = {"chain_id": result.chain_id, "turn": result.turn, "resume_status": result.resume_status,
                "finish_reason": result.finish_reason, "usage": msgspec.to_builtins(result.usage),
                "pruned": msgspec.to_builtins(result.pruned)}
        extra = {"cost": 0.0, "agentrt": info}
        try:
            actions = self._actions(result)
        except FormatError as e:  # the chain holds the reply; the agent's history will not
            e.messages[0]["extra"].update(extra, response=content)
            raise
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.config.actions == "toolcall":
            message["tool_calls"] = msgspec.to_builtins(result.message.tool_calls)
        message["extra"] = {"actions": actions, **extra, "timestamp": time.time()}
        self._held.append(_key(message))
        return message

    def _actions(self, result: TurnResult) -> list[dict[str, Any]]:
        template_kwargs = {"finish_reason": result.finish_reason}
        if self.config.actions == "toolcall":
            return parse_toolcall_actions(result.message.tool_calls, template_kwargs=template_kwargs,
                                          format_error_template=self.config.format_error_template)
        return parse_regex_actions(result.message.content, action_regex=self.config.action_regex,
                                   format_error_template=self.config.format_error_template,
                                   template_kwargs=template_kwargs)

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        return expand_multimodal_content(kwargs, pattern=self.config.multimodal_regex)

    def format_observation_messages(self, message: dict[str, Any], outputs: list[dict[str, Any]],
                                    template_vars: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if self.config.actions == "toolcall":
            return format_toolcall_observation_messages(
                actions=message.get("extra", {}).get("actions", []), outputs=outputs,
                observation_template=self.config.observation_template, template_vars=template_vars,
                multimodal_regex=self.config.multimodal_regex)
        return format_observation_messages(outputs, observation_template=self.config.observation_template,
                                           template_vars=template_vars, multimodal_regex=self.config.multimodal_regex)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict[str, Any]:
        return {"info": {
            "config": {"model": self.config.model_dump(mode="json", exclude={"api_key"}),
                       "model_type": f"{self.__class__.__module__}.{self.__class__.__name__}"},
            "agentrt": {"chain_ids": list(self.chain_ids), "num_recomputed": self.num_recomputed}}}


def _check_start(messages: list[dict[str, Any]]) -> None:
    if len(messages) < 2 or messages[0].get("role") != "system":
        raise HistoryError("a run starts with the system message followed by the task")
    if any(m.get("role") == "assistant" for m in messages):
        raise HistoryError("a new chain can only start from the system message and user messages: the "
                           "assistant messages of this history were not generated by an agentrt chain")


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise HistoryError(f"agentrt chains take text messages only; got content {content!r:.80}")


def _key(message: Mapping[str, Any]) -> tuple[str, str]:
    return str(message.get("role")), _text(message)
