"""The agent-trace format: JSONL, one header line, then one line per turn (see docs/sdk.md "Agent traces").

A turn appends ``messages`` (a user message or tool results) and then the assistant emits exactly
``output_token_ids`` (replayed with forced decoding; ``output_text`` is their decoding, which a stateless
client re-sends as the assistant message). ``think_time_s`` is the agent's pause before its next turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

TRACE_VERSION = 1
Count = Annotated[int, Meta(ge=0)]


class TraceError(ValueError):
    """A trace file that does not parse: the message names the file, the line and the field."""


class _Strict(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TraceMessage(_Strict, kw_only=True, omit_defaults=True):
    role: Literal["user", "tool"]
    content: str
    name: str | None = None  # the tool's name (tool results)
    tool_call_id: str | None = None


class TraceHeader(_Strict, kw_only=True, tag_field="type", tag="header"):
    version: Literal[1] = TRACE_VERSION
    trace_id: Annotated[str, Meta(min_length=1)]
    system_prompt: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: str | None = None  # what the token ids and counts refer to
    vocab_size: Annotated[int, Meta(ge=1)] | None = None
    seed: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class TraceTurn(_Strict, kw_only=True, tag_field="type", tag="turn"):
    index: Count
    messages: Annotated[list[TraceMessage], Meta(min_length=1)]
    output_token_ids: Annotated[list[Count], Meta(min_length=1)]
    output_text: str
    think_time_s: Annotated[float, Meta(ge=0.0)] = 0.0


class Trace(Struct, kw_only=True):
    header: TraceHeader
    turns: list[TraceTurn]

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def dumps(trace: Trace) -> bytes:
    enc = msgspec.json.Encoder()
    return b"".join(enc.encode(line) + b"\n" for line in [trace.header, *trace.turns])


def write(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.write_bytes(dumps(trace))
    return path


def write_many(traces: Iterable[Trace], directory: str | Path) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [write(t, directory / f"{t.header.trace_id}.jsonl") for t in traces]


_HEADER = msgspec.json.Decoder(TraceHeader)
_TURN = msgspec.json.Decoder(TraceTurn)


def loads(data: bytes | str, source: str = "<trace>") -> Trace:
    """Parse and validate a trace; TraceError names ``source:line`` and the offending field."""
    raw = data.encode() if isinstance(data, str) else data
    lines = [(n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
    if not lines:
        raise TraceError(f"{source}: empty trace (expected a header line)")
    header = _decode(_HEADER, *lines[0], source)
    turns = [_decode(_TURN, n, line, source) for n, line in lines[1:]]
    if not turns:
        raise TraceError(f"{source}: the trace has a header but no turns")
    for (n, _), turn, want in zip(lines[1:], turns, range(len(turns))):
        if turn.index != want:
            raise TraceError(f"{source}:{n}: field `index` is {turn.index}, expected {want} (turns in order)")
        if header.vocab_size is not None and max(turn.output_token_ids) >= header.vocab_size:
            raise TraceError(f"{source}:{n}: field `output_token_ids` holds an id >= vocab_size {header.vocab_size}")
        for k, m in enumerate(turn.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise TraceError(f"{source}:{n}: field `messages[{k}].tool_call_id` is required for a tool result")
    return Trace(header=header, turns=turns)


def load(path: str | Path) -> Trace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror}") from None
    return loads(data, str(path))


def _decode(decoder: msgspec.json.Decoder, n: int, line: bytes, source: str) -> Any:
    try:
        return decoder.decode(line)
    except msgspec.ValidationError as exc:  # the message ends "- at `$.field[...]`"
        raise TraceError(f"{source}:{n}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{source}:{n}: not JSON: {exc}") from None
