"""Synthetic agent traces shaped like coding-agent trajectories, with real token counts.

A trace is one task: a user request, then turns of (tool result -> short assistant turn with the next tool
call), ending with a short answer. Lengths come from a seeded ``random.Random``; tool results have
log-uniform lengths (many short outputs, a few long file dumps). Text is random code-like words, and every
count is measured with the given tokenizer (``len(tokenizer.encode(text))``), so the same seed and
tokenizer always give the same trace.

``fit_trace`` makes a trace fit a model's context (``max_model_len``): it scales the system prompt, the task
and the tool results down by one factor (turns and assistant outputs stay as sampled) until the whole
conversation fits.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt.replay.trace import Trace, TraceHeader, TraceMessage, TraceTurn

TOOLS = ["bash", "read_file", "grep", "edit_file", "run_tests"]
_WORDS = ("def class return import from self None True False if else for in while try except raise with as "
          "async await yield lambda assert pass break continue print len range dict list str int float "
          "config engine request chain token page cache model layer tensor batch prefix index error test "
          "src tests docs utils main server client schema kernel scheduler runner sampler loader").split()
_PUNCT = ["(", ")", ":", ",", ".", "=", "==", "+", "-", "[", "]", "_", "/", "#", "'", '"']


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class SynthShapeError(ValueError):
    """A shape whose ranges are empty or negative, or a trace that cannot fit a model's context; ``field`` names
    the shape's field to change."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class SynthShape:
    """Ranges are inclusive ``(lo, hi)``; token counts are of the message content alone. An assistant turn
    with a tool call is never shorter than its ``<tool_call>`` block."""

    num_turns: tuple[int, int] = (30, 50)
    system_tokens: int = 2000
    task_tokens: tuple[int, int] = (60, 200)
    tool_tokens: tuple[int, int] = (200, 4000)
    output_tokens: tuple[int, int] = (24, 96)
    think_time_s: tuple[float, float] = (0.5, 3.0)

    def __post_init__(self) -> None:
        for name in ("num_turns", "task_tokens", "tool_tokens", "output_tokens", "think_time_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise SynthShapeError(f"{name} must be a range 0 <= lo <= hi, got {(lo, hi)}", name)
        for name, low, least in (("num_turns", self.num_turns[0], 1), ("system_tokens", self.system_tokens, 1),
                                 ("output_tokens", self.output_tokens[0], 8)):
            if low < least:
                raise SynthShapeError(f"{name} must be >= {least}, got {getattr(self, name)}", name)


def _words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        r = rng.random()
        word = rng.choice(_PUNCT) if r < 0.2 else str(rng.randrange(1000)) if r < 0.3 else rng.choice(_WORDS)
        out.append(("\n" if rng.random() < 0.08 else " ") + word if i else word)
    return "".join(out)


def text_of_tokens(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random code-like text whose encoding is ``num_tokens`` tokens long (off by a few at most when the
    cut point re-tokenizes differently)."""
    if num_tokens == 0:
        return ""
    text = _words(rng, num_tokens)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        text += " " + _words(rng, num_tokens)
        ids = tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)
    while len(tokenizer.encode(text, add_special_tokens=False)) > num_tokens and text:
        text = text[:-1]
    return text


def _tool_call(tokenizer: Tokenizer, rng: random.Random, tool: str, num_tokens: int) -> str:
    """A short assistant turn: a thought, then a ``<tool_call>`` block (None tool: a final answer)."""
    call = json.dumps({"name": tool, "arguments": {"command": _words(rng, 4).replace("\n", " ")}})
    block = f"\n<tool_call>\n{call}\n</tool_call>"
    used = len(tokenizer.encode(block, add_special_tokens=False))
    return text_of_tokens(tokenizer, rng, max(1, num_tokens - used)) + block


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(max(hi, 1)))))))


def synth_trace(tokenizer: Tokenizer, seed: int, shape: SynthShape = SynthShape(), *,
                tokenizer_name: str | None = None, vocab_size: int | None = None, scale: float = 1.0) -> Trace:
    """``scale`` multiplies the lengths of the system prompt, the task and every tool result (fit_trace)."""
    rng = random.Random(seed)
    num_turns = rng.randint(*shape.num_turns)
    system = "You are a coding agent. Use the tools to inspect and change the repository.\n"
    system += text_of_tokens(tokenizer, rng, max(0, round(shape.system_tokens * scale) - len(tokenizer.encode(system))))
    tools: list[dict[str, Any]] = [{"type": "function", "function": {
        "name": t, "description": f"{t} in the repository",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}} for t in TOOLS]
    turns: list[TraceTurn] = []
    previous_tool = None
    for index in range(num_turns):
        if index == 0:
            messages = [TraceMessage(role="user", content="Fix the failing test.\n" + text_of_tokens(
                tokenizer, rng, round(rng.randint(*shape.task_tokens) * scale)))]
        else:
            length = max(1, round(_log_uniform(rng, *shape.tool_tokens) * scale))
            messages = [TraceMessage(role="tool", name=previous_tool, tool_call_id=f"call_{index - 1}",
                                     content=text_of_tokens(tokenizer, rng, length))]
        num_out = rng.randint(*shape.output_tokens)
        last = index == num_turns - 1
        previous_tool = rng.choice(TOOLS)
        text = text_of_tokens(tokenizer, rng, num_out) if last else _tool_call(tokenizer, rng, previous_tool, num_out)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        turns.append(TraceTurn(index=index, messages=messages, output_token_ids=ids,
                               output_text=tokenizer.decode(ids, skip_special_tokens=False),
                               think_time_s=0.0 if last else round(rng.uniform(*shape.think_time_s), 3)))
    metadata: dict[str, Any] = {"generator": "agentrt.replay.synth", "shape": _shape_dict(shape)}
    if scale != 1.0:
        metadata["scale"] = round(scale, 4)
    header = TraceHeader(trace_id=f"synth-{seed}", system_prompt=system, tools=tools, tokenizer=tokenizer_name,
                         vocab_size=vocab_size, seed=seed, metadata=metadata)
    return Trace(header=header, turns=turns)


def scalable_tokens(tokenizer: Tokenizer, trace: Trace) -> int:
    """Tokens of what ``scale`` shrinks: the system prompt, the task and the tool results."""
    texts = [trace.header.system_prompt] + [m.content for turn in trace.turns for m in turn.messages]
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def fit_trace(tokenizer: Tokenizer, seed: int, shape: SynthShape, max_tokens: int, count: Callable[[Trace], int],
              **kw: Any) -> Trace:
    """``synth_trace``, scaled down until ``count(trace)`` (the tokens the whole conversation takes on the
    server) is at most ``max_tokens``; SynthShapeError when even the turns without those parts do not fit."""
    scale, trace = 1.0, synth_trace(tokenizer, seed, shape, **kw)
    for _ in range(8):
        total = count(trace)
        if total <= max_tokens:
            return trace
        scalable = scalable_tokens(tokenizer, trace)
        fixed = total - scalable  # outputs, tool definitions and the chat template: kept whatever the scale
        if fixed >= max_tokens:
            raise SynthShapeError(f"trace {trace.header.trace_id} has {trace.num_turns} turns whose assistant "
                                  f"outputs, tool definitions and chat template alone take {fixed} tokens; the "
                                  f"model holds {max_tokens}", "num_turns")
        # a few tokens under the target: text cut at a token count re-tokenizes a little differently
        scale *= (max_tokens - fixed) / scalable * 0.98
        trace = synth_trace(tokenizer, seed, shape, scale=scale, **kw)
    raise SynthShapeError(f"trace {trace.header.trace_id} of {trace.num_turns} turns still takes {count(trace)} "
                          f"tokens scaled down by {scale:.3g}; the model holds {max_tokens}", "num_turns")


def synth_traces(tokenizer: Tokenizer, num: int, seed: int = 0, shape: SynthShape = SynthShape(),
                 **kw: Any) -> list[Trace]:
    return [synth_trace(tokenizer, seed + i, shape, **kw) for i in range(num)]


def _shape_dict(shape: SynthShape) -> dict[str, Any]:
    return {k: list(v) if isinstance(v := getattr(shape, k), tuple) else v
            for k in shape.__slots__}  # type: ignore[attr-defined]
