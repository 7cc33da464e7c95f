"""Where a tool call's arguments lie among the tokens of the assistant turn that made it: the token spans that
Anthropic's ``clear_tool_inputs`` prunes from a chain's KV (agentrt.clear_tool_uses), and interval helpers over
such spans. Text offsets come from decoding the tokens; no tokenizer offsets are needed."""

from __future__ import annotations

from typing import Any

from agentrt.tool_syntax import ToolCallReader
from agentrt.tool_syntax.base import arguments_value


def _token_offsets(decode: Any, ids: list[int]) -> tuple[str, list[int | None]]:
    """The text of ``ids`` and, per token boundary ``i``, the length of the text of ``ids[:i]`` (None at a
    boundary inside a character: a multi-byte character split over tokens). Linear: each step decodes the tokens
    since the last whole boundary after the window before it (agentrt's incremental detokenizer's scheme, so that
    a decoder that strips a window's leading space strips it from the context only); should the pieces still not
    make the whole text, every prefix is decoded instead."""
    full = decode(ids)
    offsets: list[int | None] = [0] + [None] * len(ids)
    text, prefix, base = "", 0, 0
    for i in range(1, len(ids) + 1):
        before, after = decode(ids[prefix:base]), decode(ids[prefix:i])
        if (len(after) <= len(before) or after.endswith("\ufffd")) and i < len(ids):
            continue
        text += after[len(before):]
        offsets[i], prefix, base = len(text), base, i
    if text != full:
        for i in range(1, len(ids) + 1):
            prefix = decode(ids[:i])
            offsets[i] = len(prefix) if full.startswith(prefix) and not prefix.endswith("\ufffd") else None
        offsets[-1] = len(full)
    return full, offsets


def call_input_spans(decode: Any, ids: list[int], reader: ToolCallReader) -> list[tuple[str, Any, int, int] | None]:
    """Per call in the tokens ``ids`` (an assistant turn's region) in the reader's syntax, in order: its name,
    its arguments' value and the span ``[lo, hi)`` of the tokens that spell the arguments (the fewest tokens
    covering their text: a token at either edge may carry a space or some of the markup too); None for a call
    without arguments."""
    text, offsets = _token_offsets(decode, ids)
    found: list[tuple[str, Any, int, int] | None] = []
    for parsed in reader.parsed(text):
        if parsed.arguments is None:
            found.append(None)
            continue
        a, b = parsed.arguments
        lo = max(i for i, at in enumerate(offsets) if at is not None and at <= a)
        hi = min(i for i, at in enumerate(offsets) if at is not None and at >= b)
        found.append((parsed.call.function.name, arguments_value(parsed.call.function.arguments), lo, hi))
    return found


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif lo < hi:
            out.append((lo, hi))
    return out


def covered(span: tuple[int, int], intervals: list[tuple[int, int]]) -> bool:
    """Whether the token span lies wholly within the union of ``intervals``."""
    lo, hi = span
    for a, b in merged(intervals):
        if a > lo:
            break
        lo = max(lo, b)
    return lo >= hi
