"""Structured outputs: a grammar per request, applied as a token mask in the sampler (docs/structured-outputs.md).

A ``StructuredSpec`` in ``SamplingParams.structured`` names what the output must match: any JSON object, a JSON
schema, a regex, an EBNF grammar, or tool calls in the model's call syntax (one or more calls and nothing else, or
free text in which every call that starts must be whole and valid). The engine compiles a spec once
(``StructuredOutputs``: an LRU cache by spec, so requests of the same schema share it), gives each request a
matcher, and advances the matcher with every token the request takes, forced tokens included. Before a step that
samples constrained rows the sampler gets one bitmask for those rows (``StepMasks``): each token the grammar
forbids gets -inf before temperature, top-k, top-p and min-p; the other rows are not touched. The request stops
(finish reason ``stop``) when its grammar can take nothing more, or when it takes a stop token the grammar allows.

The grammar engine is llguidance (docs/structured-outputs.md has the measurements behind the choice,
``python -m benchmarks.grammar_mask``); it is imported with the first constrained request.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidSamplingParamsError

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "regex", "ebnf", "tool_calls")
# JSON as json.dumps writes it (and chat templates render tool arguments): these separators, no other whitespace.
# Defaults: a schema's own "x-guidance" options win over them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The Hermes / Qwen call syntax (the embedded model's chat template); "{name}" stands for the tool's name as JSON.
TOOL_CALL_BEGIN = '<tool_call>\n{"name": {name}, "arguments": '
TOOL_CALL_END = "}\n</tool_call>"
TOOL_CALL_SEPARATOR = "\n"
TOOL_CALL_TRIGGER = "<tool_call>"


def _bad(why: str) -> InvalidSamplingParamsError:
    return InvalidSamplingParamsError(f"structured {why}")


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a request's output must match. ``value``: the JSON schema (JSON text) for json_schema, the pattern for
    regex, the grammar for ebnf (llguidance's Lark syntax, ``start: ...``, or llama.cpp's GBNF, ``root ::= ...``),
    the tools and options as JSON for tool_calls (build it with ``StructuredSpec.tool_calls``), empty for
    json_object. Hashable: the compiled-grammar cache is keyed by it."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _bad(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise _bad(f"value must be a str, got {type(self.value).__name__}")
        if self.kind in ("regex", "ebnf") and not self.value:
            raise _bad(f"{self.kind} must not be empty")
        if self.kind in ("json_schema", "tool_calls"):
            try:
                parsed = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise _bad(f"{self.kind} is not valid JSON: {exc}") from None
            if self.kind == "json_schema" and not isinstance(parsed, dict):
                raise _bad("json_schema must be a JSON object")
            if self.kind == "tool_calls":
                _check_tool_calls(parsed)

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredSpec:
        """The properties come in the schema's order: keep it (the spec is not normalized)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False))

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> StructuredSpec:
        return cls("ebnf", grammar)

    @classmethod
    def tool_calls(cls, tools: Sequence[tuple[str, dict | None]], *, required: bool = True,
                   max_calls: int | None = None, content: dict | None = None, begin: str = TOOL_CALL_BEGIN,
                   end: str = TOOL_CALL_END, separator: str = TOOL_CALL_SEPARATOR,
                   trigger: str = TOOL_CALL_TRIGGER, open: str = "", close: str = "",
                   parameter_begin: str = "", parameter_end: str = "") -> StructuredSpec:
        """Calls of ``tools``: (name, JSON schema of the arguments, or None for any JSON object). A call is
        ``begin`` (``{name}`` replaced by the name as JSON, ``{bare_name}`` by the name itself), the arguments,
        ``end``; the calls are joined by ``separator`` and, where the syntax wraps them, written between ``open``
        and ``close``. The arguments are one JSON value, or with ``parameter_begin`` one part per parameter in
        the schema's order (the required ones present): ``parameter_begin`` (``{key}`` replaced by the
        parameter's name), the value (a string parameter's as bare text without ``parameter_end``, any other's
        as JSON), ``parameter_end``. ``required``: one or more calls and nothing else; otherwise free text in
        which calls start at ``trigger`` (a prefix of ``open``, or of ``begin`` where nothing wraps the calls)
        and must then be whole and valid, or, with ``content`` (a JSON schema), either one JSON value of that
        schema or calls as under ``required``. ``max_calls`` 1: at most one call."""
        body = {"tools": [{"name": n, "parameters": p} for n, p in tools], "required": required,
                "max_calls": max_calls, "content": content, "begin": begin, "end": end, "separator": separator,
                "trigger": trigger, "open": open, "close": close, "parameter_begin": parameter_begin,
                "parameter_end": parameter_end}
        return cls("tool_calls", json.dumps(body, ensure_ascii=False))


def _check_tool_calls(body: Any) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("tools"), list) or not body["tools"]:
        raise _bad("tool_calls needs a non-empty list of tools")
    for t in body["tools"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad("tool_calls: every tool needs a non-empty name")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise _bad(f"tool_calls: the parameters of {t['name']!r} must be a JSON schema object")
    for key in ("begin", "end", "separator", "trigger", "open", "close", "parameter_begin", "parameter_end"):
        if not isinstance(body.setdefault(key, ""), str):
            raise _bad(f"tool_calls: {key} must be a str")
    if "{name}" not in body["begin"] and "{bare_name}" not in body["begin"]:
        raise _bad("tool_calls: begin must hold {name} or {bare_name}")
    if not body["trigger"] or not (body["open"] or body["begin"]).startswith(body["trigger"]):
        raise _bad("tool_calls: the trigger must be a non-empty prefix of open (or of begin, without open)")
    if bool(body["open"]) != bool(body["close"]):
        raise _bad("tool_calls: open and close come together")
    if body["parameter_begin"] and ("{key}" not in body["parameter_begin"] or not body["parameter_end"]):
        raise _bad("tool_calls: parameter_begin must hold {key}, and parameter_end must follow it")
    if body.get("max_calls") not in (None, 1):
        raise _bad("tool_calls: max_calls must be 1 or None")
    if body.get("content") is not None and not isinstance(body["content"], dict):
        raise _bad("tool_calls: content must be a JSON schema object")


def _spelled_bare(schema: dict) -> bool:
    """Whether a parameter's value is written as bare text (a string), not as JSON."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return all(isinstance(c, str) for c in choices)
    return schema.get("type") == "string"


def _with_json_options(schema: dict) -> dict:
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


# --- compiling ----------------------------------------------------------------------------------------------


class StructuredOutputs:
    """The grammars of one engine: compiles specs for its tokenizer and vocabulary (an LRU cache of ``cache_size``
    by spec), makes a matcher per request and the masks of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 256):
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:
            raise _bad("needs the llguidance package (pip install llguidance)") from exc
        self._llg = llguidance
        stop = sorted(set(stop_token_ids)) or None
        try:
            self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop)
        except ValueError as exc:  # a slow (Python) tokenizer
            raise _bad(f"cannot use this tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        # text -> id of the tokens llguidance treats as special (every added token): grammars name them as tokens
        self._special = {text: i for text, i in tokenizer.get_added_vocab().items()
                         if text and i < vocab_size and self._tok.is_special_token(i)}
        self._special_texts = sorted(self._special, key=len, reverse=True)  # longest first
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._executor = None
        self._bitmask = torch.empty(0)
        self.num_compiled = 0  # grammars compiled (cache misses)

    def compiled(self, spec: StructuredSpec) -> Any:
        """A matcher of ``spec`` in its start state, never advanced (cached; requests get copies);
        InvalidSamplingParamsError naming ``structured`` if the spec does not compile."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        grammar = self.grammar(spec)
        matcher = self._llg.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise _bad(f"{spec.kind} does not compile: {_first_line(matcher.get_error())}")
        self.num_compiled += 1
        self._cache[spec] = matcher
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return matcher

    def grammar(self, spec: StructuredSpec) -> str:
        """The llguidance grammar (its JSON form) of ``spec``."""
        m = self._llg.LLMatcher
        if spec.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            return m.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.value)
        if spec.kind == "ebnf":
            try:
                return self._llg.grammar_from("grammar", spec.value)
            except ValueError as exc:
                raise _bad(f"ebnf does not parse: {_first_line(str(exc))}") from None
        body = json.loads(spec.value)
        _check_tool_calls(body)  # fills in the keys a spec written without them leaves out
        return m.grammar_from_lark(self._tool_call_lark(body))

    def _tool_call_lark(self, body: dict) -> str:
        """The Lark grammar of ``StructuredSpec.tool_calls``. Added tokens (``<tool_call>``) are special to
        llguidance, so where the syntax's texts hold one the grammar names the token. The lazy form's free text
        may not spell a special trigger out in plain text either, so that no call escapes the grammar; a plain
        text trigger ends the free text at its first occurrence (a lazy lexeme). A trigger that starts with a
        special token triggers on that token."""
        trigger, required, one = body["trigger"], body["required"], body["max_calls"] == 1
        content, wrapped = body.get("content"), bool(body["open"])
        lazy = not required and content is None
        special = lazy and next((t for t in self._special_texts if trigger.startswith(t)), None)
        if special:
            trigger = special
        lines, names = ["%llguidance {}"], []
        for i, tool in enumerate(body["tools"]):
            name = tool["name"]
            begin = body["begin"].replace("{name}", json.dumps(name, ensure_ascii=False)).replace("{bare_name}", name)
            items = [self._lark_text(begin), self._arguments_lark(body, tool, f"call_{i}", lines),
                     self._lark_text(body["end"])]
            if lazy and not wrapped:
                items[0] = self._lark_text(begin[len(trigger):])
                items.insert(0, f"TEXT <[{self._special[trigger]}]>" if special else "trigger")
            lines.append(f"call_{i}: " + " ".join(items))
            names.append(f"call_{i}")
        lines.append("call: " + " | ".join(names))
        calls = "call" if one else f"call ({self._lark_text(body['separator'])} call)*"
        if wrapped:
            opening = body["open"]
            if lazy:
                head = f"TEXT <[{self._special[trigger]}]>" if special else "trigger"
                lines.append(f"section: {head} {self._lark_text(opening[len(trigger):])} {calls} "
                             f"{self._lark_text(body['close'])}")
            else:
                lines.append(f"section: {self._lark_text(opening)} {calls} {self._lark_text(body['close'])}")
            calls = "section"
        if required:
            lines.append(f"start: {calls}")
        elif content is not None:
            lines.append(f"start: %json {json.dumps(_with_json_options(content))} | {calls}")
        else:
            if wrapped:
                lines.append("start: section? TEXT")
            else:
                lines.append(f"start: call{'?' if one else '*'} TEXT")
            if special:
                lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex_literal(trigger)}(?s:.*)/")
            else:
                lines += ["TEXT: /(?s:.*)/", f"trigger[lazy]: TEXT {json.dumps(trigger, ensure_ascii=False)}"]
        return "\n".join(lines)

    def _arguments_lark(self, body: dict, tool: dict, rule: str, lines: list[str]) -> str:
        """The Lark items of one call's arguments (helper rules appended to ``lines``, named after ``rule``):
        one JSON value, or one part per parameter (``StructuredSpec.tool_calls``)."""
        schema = tool["parameters"] if tool["parameters"] is not None else {"type": "object"}
        if not body["parameter_begin"]:
            return "%json " + json.dumps(_with_json_options(schema))
        before, after = body["parameter_begin"].split("{key}", 1)
        end = body["parameter_end"]
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not properties:  # any parameters: names and values as bare text
            if not any(line.startswith("PARAMETER_NAME") for line in lines):
                lines.append("PARAMETER_NAME: /[^<>\\n]+/")
            lines.append(f"{rule}_any: {self._lark_text(before)} PARAMETER_NAME {self._lark_text(after)} "
                         f"{self._bare_value({}, end, lines)}")
            return f"{rule}_any*"
        required, parts = set(schema.get("required") or []), []
        for k, (key, sub) in enumerate(properties.items()):
            sub = sub if isinstance(sub, dict) else {}
            value = self._bare_value(sub, end, lines) if _spelled_bare(sub) else \
                f"%json {json.dumps(_with_json_options(sub))} {self._lark_text(end)}"
            lines.append(f"{rule}_p{k}: {self._lark_text(before + key + after)} {value}")
            parts.append(f"{rule}_p{k}" + ("" if key in required else "?"))
        return " ".join(parts)

    def _bare_value(self, schema: dict, end: str, lines: list[str]) -> str:
        """The items of a string parameter's bare value and the ``end`` after it: one of its ``enum`` / ``const``
        strings, else any text within its length bounds that ends at the first ``end`` (a lazy lexeme; where
        ``end`` starts with a special token, at that token, and the text may not spell the token out). Patterns
        and formats are not followed in this form."""
        choices = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices is not None:
            return "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + f") {self._lark_text(end)}"
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        name = f"bare_{low}_{high if high is not None else 'n'}"
        if not any(line.startswith(name) for line in lines):
            text = f"(?s:.{{{low},{int(high) if high is not None else ''}}})"
            special = next((t for t in self._special_texts if end.startswith(t)), None)
            if special:
                lines.append(f"{name.upper()}: /{text}/ & ~/(?s:.*){_regex_literal(special)}(?s:.*)/")
                lines.append(f"{name}: {name.upper()} {self._lark_text(end)}")
            else:
                lines += [f"{name.upper()}: /{text}/",
                          f"{name}[lazy]: {name.upper()} {json.dumps(end, ensure_ascii=False)}"]
        return name

    def _lark_text(self, text: str) -> str:
        """``text`` as Lark items: string literals, with each special token it holds named by id (``<[510]>``)."""
        items, pos, start = [], 0, 0
        while pos < len(text):
            name = next((n for n in self._special_texts if text.startswith(n, pos)), None)
            if name is None:
                pos += 1
                continue
            if pos > start:
                items.append(json.dumps(text[start:pos], ensure_ascii=False))
            items.append(f"<[{self._special[name]}]>")
            pos = start = pos + len(name)
        if start < len(text):
            items.append(json.dumps(text[start:], ensure_ascii=False))
        return " ".join(items) if items else '""'

    def matcher(self, spec: StructuredSpec, forced_token_ids: Sequence[int] = ()) -> Any:
        """A new matcher for a request of ``spec``; InvalidSamplingParamsError if the spec does not compile or the
        grammar refuses one of ``forced_token_ids`` (checked on a copy)."""
        m = self.compiled(spec).deep_copy()
        if forced_token_ids:
            probe = m.deep_copy()
            for i, t in enumerate(forced_token_ids):
                if not probe.consume_token(t):
                    raise InvalidSamplingParamsError(
                        f"forced_token_ids[{i}] = {t} is not allowed there by the structured {spec.kind} grammar")
        return m

    def step_masks(self, matchers: Sequence[Any | None]) -> StepMasks | None:
        """The masks of a step whose sampled rows have ``matchers`` (None: unconstrained); None if no row is."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        return StepMasks(self, rows, [matchers[i] for i in rows])

    def fill(self, matchers: Sequence[Any]) -> torch.Tensor:
        """The bitmask [len(matchers), ceil(vocab / 32)] int32 on the host: bit j % 32 of word j // 32 of row r is
        set when token j is allowed by ``matchers[r]``. Several rows are filled by llguidance's thread pool. The
        buffer is reused across steps (pinned where there is a GPU, so its copy to the device does not wait): a
        step's sampling has read it before the host fills it again."""
        n, words = len(matchers), (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.empty((max(n, 2 * self._bitmask.shape[0]), words), dtype=torch.int32,
                                        pin_memory=torch.cuda.is_available())
        bitmask = self._bitmask[:n]
        if n == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = self._llg.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(m, r) for r, m in enumerate(matchers)], bitmask.data_ptr(),
                                                   words * 4, n)
        return bitmask


def advance(matcher: Any, token_id: int) -> bool:
    """Advance a request's matcher by the token it took; True when its grammar ends there: nothing more can
    follow (a stop token was taken, or the grammar is complete and admits no continuation), or the grammar
    refused the token (which the mask rules out for sampled tokens and ``matcher`` for forced ones)."""
    if matcher.consume_token(token_id):
        return matcher.is_stopped()
    log.error("structured output: the grammar refused token %d (%s); the request stops here", token_id,
              _first_line(matcher.get_error()))
    return True


def schema_error(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON schema that structured outputs can follow (None: it is one); no tokenizer
    needed, so a server can answer a bad schema before it reaches the engine."""
    if not isinstance(schema, dict):
        return "must be a JSON object"
    try:
        import llguidance
    except ImportError:
        return "structured outputs need the llguidance package (pip install llguidance)"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        return _first_line(str(exc))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return _first_line(error) if error else None


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else str(text)


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching itself, fit for a Lark ``/.../`` (every character but letters and digits as
    a ``\\x{..}`` escape)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


# --- the mask -----------------------------------------------------------------------------------------------


class StepMasks:
    """One step's token masks: row ``rows[r]`` of the step's logits is constrained by ``matchers[r]``. The
    bitmask is filled when the sampler applies it, so on a GPU the host fills it while the step's forward runs."""

    def __init__(self, owner: StructuredOutputs, rows: list[int], matchers: list[Any]):
        self.owner = owner
        self.rows = rows
        self.matchers = matchers

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [n, V] with every token a row's grammar forbids at -inf, as a new tensor (``logits`` stays
        the model's: the sampler's log probabilities are of it)."""
        out = logits.clone()
        apply_token_bitmask(out, self.owner.fill(self.matchers), self.rows)
        return out


_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
assert sys.byteorder == "little", "apply_token_bitmask reads the int32 bitmask words byte by byte"


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit (least significant first) is set, -inf elsewhere."""
    key = (device, dtype)
    table = _BIAS.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BIAS[key] = torch.zeros(256, 8, dtype=dtype).masked_fill(bits == 0, float("-inf")).to(device)
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> None:
    """In place: row ``rows[r]`` of ``logits`` [n, V] gets -inf at every token whose bit in ``bitmask[r]`` is 0
    (int32 words; token j is bit j % 32 of word j // 32); other rows are not touched. One table lookup per
    bitmask byte gives a 0 / -inf bias that is added to the rows, on the logits' device."""
    vocab = logits.shape[1]
    num_rows, words = bitmask.shape
    assert words * 32 >= vocab, "the bitmask is narrower than the vocabulary"
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    byte_ids = bitmask.view(torch.uint8).long()  # [rows, 4 * words]: byte b of word w holds bits 8b..8b+7
    bias = _byte_bias(logits.device, logits.dtype)[byte_ids].view(num_rows, words * 32)[:, :vocab]
    if not isinstance(rows, torch.Tensor):
        if list(rows) == list(range(logits.shape[0])):
            logits.add_(bias)
            return
        rows = torch.tensor(rows, device=logits.device)
    logits[rows] += bias
