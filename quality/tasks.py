"""Seeded synthetic tasks whose answer sits far back in the context.

Every generator returns a `Sample`: the prompt's token ids, the exact answer token ids the model must emit
(greedy) before its end token, and where the asked fact sits. Lengths are in tokens of the given tokenizer
(the haystack is grown until the prompt reaches ``length``; the result is within one filler sentence).

* ``needle``: ``num_keys`` facts "The magic number for <key> is <5 digits>." in filler prose; one is asked at
  the end (multi-key needle in a haystack, the question last).
* ``vartrack``: chains "VAR A = 12345." ... "VAR B = VAR A." (``hops`` assignments); the last name is asked.
* ``tool_lookup``: a ChatML conversation with tools (rendered by the tokenizer's chat template); each round
  looks up a record whose tool result holds its code; the last user turn asks for the code of one round.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

TASKS = ("needle", "vartrack", "tool_lookup")
RETRIEVAL_TASKS = ("needle", "tool_lookup")

_WORDS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education river garden window paper music
market bread village letter table mountain forest road summer winter bridge island valley ocean station
train engine light stone glass field farm horse wind cloud rain snow fire tree leaf flower seed""".split()
_VERBS = "sees finds keeps makes takes brings holds moves reads writes builds opens carries follows".split()
_ADJS = "old new small large quiet busy warm cold bright dark green early late simple heavy".split()
_COLORS = "red blue green amber silver golden black white violet orange crimson ivory coral jade olive teal".split()
_ANIMALS = """falcon tiger otter badger heron lynx panda raven salmon walrus beetle cobra dingo eagle ferret gecko
hyena ibis jackal koala lemur marmot newt ocelot parrot quail rabbit shark toucan viper wombat yak zebra""".split()
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
SYSTEM_PROMPT = "You are a records assistant."
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup_record", "description": "Fetch a record by its id",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}


@dataclass(slots=True)
class Sample:
    task: str
    prompt_ids: list[int]
    answer_ids: list[int]
    answer: str
    depth: float  # where the asked fact sits, as a fraction of the prompt (0 = start)
    meta: dict[str, Any] = field(default_factory=dict)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 9))]
    words.insert(1, rng.choice(_VERBS))
    if rng.random() < 0.5:
        words.insert(0, rng.choice(_ADJS))
    return " " + " ".join(words).capitalize() + "."


def _keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample([f"{c} {a}" for c in _COLORS for a in _ANIMALS], n)


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def record_key(rng: random.Random) -> str:
    return f"{rng.choice(_COLORS)[:3].upper()}-{rng.randint(100, 999)}"


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(3))


def _check(length: int, depth: float) -> None:
    if not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an int >= 64 tokens, got {length!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")


class _Encoder:
    """Token counts of short strings (memoised: the filler is built from a few thousand distinct sentences)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lengths: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def length(self, text: str) -> int:
        n = self._lengths.get(text)
        if n is None:
            n = self._lengths[text] = len(self.encode(text))
        return n


_ENCODERS: dict[int, _Encoder] = {}


def _encoder(tokenizer) -> _Encoder:
    enc = _ENCODERS.get(id(tokenizer))
    if enc is None or enc.tokenizer is not tokenizer:
        enc = _ENCODERS[id(tokenizer)] = _Encoder(tokenizer)
    return enc


def _end_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _haystack(enc: _Encoder, rng: random.Random, facts: list[tuple[float, str]], budget: int) -> tuple[str, list[int]]:
    """Filler of about ``budget`` tokens with each fact placed at its depth; returns text and the facts' char offsets."""
    sentences, used = [], sum(enc.length(f) for _, f in facts)
    while used < budget:
        s = _sentence(rng)
        sentences.append(s)
        used += enc.length(s)
    slots = sorted(((round(d * len(sentences)), i) for i, (d, _) in enumerate(facts)), reverse=True)
    for pos, i in slots:
        sentences.insert(pos, facts[i][1])
    offsets = [0] * len(facts)
    text, order = "", {id(f): i for i, (_, f) in enumerate(facts)}
    for s in sentences:
        if id(s) in order:
            offsets[order[id(s)]] = len(text)
        text += s
    return text, offsets


def _finish(enc: _Encoder, task: str, text: str, answer: str, fact_char: int, meta: dict) -> Sample:
    prompt_ids = enc.encode(text)
    depth = enc.length(text[:fact_char]) / max(1, len(prompt_ids)) if fact_char else 0.0
    answer_ids = enc.encode(answer)
    return Sample(task, prompt_ids, answer_ids, answer.strip(), min(1.0, depth), meta)


def needle(tokenizer, rng: random.Random, length: int, depth: float, num_keys: int = 4) -> Sample:
    _check(length, depth)
    keys, values = _keys(rng, num_keys), [_number(rng) for _ in range(num_keys)]
    asked = rng.randrange(num_keys)
    depths = [depth if i == asked else rng.random() for i in range(num_keys)]
    facts = [(d, f" The magic number for {k} is {v}.") for d, k, v in zip(depths, keys, values)]
    question = f"\nQuestion: What is the magic number for {keys[asked]}?\nAnswer:"
    enc = _encoder(tokenizer)
    hay, offsets = _haystack(enc, rng, facts, length - enc.length(question) - 1)
    return _finish(enc, "needle", hay + question, " " + values[asked], offsets[asked] + 1,
                   {"key": keys[asked], "num_keys": num_keys})


def vartrack(tokenizer, rng: random.Random, length: int, depth: float, hops: int = 2, num_chains: int = 3) -> Sample:
    _check(length, depth)
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops!r}")
    names = list(dict.fromkeys(_var_name(rng) for _ in range(hops * num_chains * 3)))[: hops * num_chains]
    if len(names) < hops * num_chains:
        raise ValueError("too few distinct variable names; lower hops or num_chains")
    asked, facts, first_fact = rng.randrange(num_chains), [], 0
    answer = ""
    for c in range(num_chains):
        chain, value = names[c * hops:(c + 1) * hops], _number(rng)
        start = depth if c == asked else rng.random()
        steps = sorted([start] + [rng.uniform(start, 1.0) for _ in range(hops - 1)])
        if c == asked:
            answer, first_fact, last_name = value, len(facts), chain[-1]
        facts.append((steps[0], f" VAR {chain[0]} = {value}."))
        facts += [(d, f" VAR {b} = VAR {a}.") for d, a, b in zip(steps[1:], chain, chain[1:])]
    question = f"\nQuestion: What is the value of VAR {last_name}?\nAnswer:"
    enc = _encoder(tokenizer)
    hay, offsets = _haystack(enc, rng, facts, length - enc.length(question) - 1)
    return _finish(enc, "vartrack", hay + question, " " + answer, offsets[first_fact] + 1, {"hops": hops})


def tool_round_messages(rng: random.Random, key: str, code: str, note_words: int) -> list[dict]:
    """One lookup round: the user's request, the assistant's tool call, the tool result, the acknowledgement."""
    notes = " ".join(rng.choice(_WORDS) for _ in range(note_words))
    call_id = f"call_{rng.randrange(16**6):06x}"
    result = json.dumps({"id": key, "code": code, "owner": rng.choice(_ANIMALS), "notes": notes})
    return [
        {"role": "user", "content": f"Look up record {key}."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "lookup_record", "arguments": {"id": key}}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": f"Record {key} retrieved."},
    ]


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=[LOOKUP_TOOL], tokenize=False,
                                         add_generation_prompt=generation_prompt)


def tool_lookup(tokenizer, rng: random.Random, length: int, depth: float, num_rounds: int | None = None,
                note_words: int = 16) -> Sample:
    """Rounds are added until the conversation reaches ``length`` tokens (or ``num_rounds`` of them, at least 2);
    ``depth`` picks the asked round (0 = the first)."""
    _check(length, depth)
    enc = _encoder(tokenizer)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    head = render(tokenizer, messages, False)
    used, keys, codes = enc.length(head) + 40, [], []
    while (len(keys) < num_rounds) if num_rounds is not None else (used < length or len(keys) < 2):
        key = record_key(rng)
        if key in keys:
            continue
        keys.append(key)
        codes.append(_number(rng))
        round_messages = tool_round_messages(rng, key, codes[-1], note_words)
        used += enc.length(render(tokenizer, [messages[0], *round_messages], False)[len(head):])
        messages += round_messages
    if num_rounds is None and len(keys) > 2 and used > length:
        keys, codes, messages = keys[:-1], codes[:-1], messages[:-4]
    rounds = len(keys)
    asked = min(rounds - 1, int(depth * rounds))
    messages.append({"role": "user", "content": f"What was the code of record {keys[asked]}?"})
    text = render(tokenizer, messages, True)
    marker = text.index(f'"id": "{keys[asked]}", "code"')
    return _finish(enc, "tool_lookup", text, codes[asked], marker,
                   {"round": asked, "num_rounds": rounds, "distance": rounds - asked})


GENERATORS = {"needle": needle, "vartrack": vartrack, "tool_lookup": tool_lookup}


def make_sample(task: str, tokenizer, rng: random.Random, length: int, depth: float, **kwargs: Any) -> Sample:
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return GENERATORS[task](tokenizer, rng, length, depth, **kwargs)


def end_token_id(tokenizer) -> int:
    """The token every answer ends with (the chat end-of-turn token, also the model's EOS)."""
    return _end_id(tokenizer)
