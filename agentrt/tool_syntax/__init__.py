"""Tool-call syntaxes: how a model spells the calls it makes, one file each, and which one a chat template
speaks (``detect``). Every route reads calls through a ``ToolCallReader`` of the served model's syntax, and the
chat renderer hands the template each call's arguments in the form that syntax's templates take
(docs/server.md, "Tool-call syntaxes")."""

from __future__ import annotations

from agentrt.tool_syntax.base import ToolSyntax
from agentrt.tool_syntax.deepseek import DeepSeek
from agentrt.tool_syntax.glm45 import Glm45
from agentrt.tool_syntax.hermes import Hermes
from agentrt.tool_syntax.kimi_k2 import KimiK2
from agentrt.tool_syntax.qwen3_coder import Qwen3Coder
from agentrt.tool_syntax.reader import ToolCallReader, ToolCallStream

SYNTAXES: dict[str, type[ToolSyntax]] = {s.name: s for s in (Hermes, Glm45, Qwen3Coder, DeepSeek, KimiK2)}
# what in a chat template shows its syntax, most specific first (Qwen3.5's template also holds "<tool_call>")
_SIGNS = (("<arg_key>", Glm45), ("<parameter=", Qwen3Coder), ("<｜tool▁call▁begin｜>", DeepSeek),
          ("<|tool_call_begin|>", KimiK2), ("<tool_call>", Hermes))

__all__ = ["SYNTAXES", "ToolCallReader", "ToolCallStream", "ToolSyntax", "by_name", "detect"]


def by_name(name: str) -> ToolSyntax:
    """The syntax called ``name``; ValueError naming the known ones otherwise."""
    if name not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {name!r}; known: {', '.join(SYNTAXES)}")
    return SYNTAXES[name]()


def detect(chat_template: str | dict[str, str] | None) -> ToolSyntax:
    """The syntax ``chat_template`` renders calls in (a tokenizer's named templates: any of them); Hermes when
    it shows none."""
    text = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    for sign, syntax in _SIGNS:
        if sign in text:
            return syntax()
    return Hermes()
