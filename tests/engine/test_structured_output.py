"""Structured outputs: grammar-constrained decoding, from the token mask up to the OpenAI route and chain turns.

The random tiny model emits garbage unconstrained, so every output that parses and follows its schema here is
the grammar's doing. Checked: JSON schemas and tool calls over several schemas and seeds at temperature 1; the
mask against llguidance's own answer at every state of random walks; the sampler never picks a masked token
(greedy, temperature, top-k/top-p/min-p, seeded) while unconstrained rows are untouched; a batch's unconstrained
requests are unchanged by constrained ones; decode windows (``decode_steps`` 4) give the single-step outputs;
errors name their field; the official ``openai`` client's json_schema / parse / tool_choice round trips; chain
turns with ``response_format`` and ``tool_choice``.
"""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel

from agentrt.tool_syntax import ToolCallReader, by_name
from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidSamplingParamsError
from engine.sampler import Sampler, make_generator
from engine.structured_output import StructuredOutputs, StructuredSpec, apply_token_bitmask
from engine.tiny_checkpoint import embedded_model_dir, random_model_dir
from tests.live_servers import client, model, server  # noqa: F401 (fixtures)

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

try:
    from jsonschema import validate as _validate
except ImportError:  # pragma: no cover - jsonschema comes with schemathesis in the test extra
    _validate = None

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "vip"]}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "active"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 16},
    "priority": {"enum": [1, 2, 3]},
    "owner": {"type": "object", "properties": {"login": {"type": "string", "maxLength": 8},
                                               "admin": {"type": "boolean"}},
              "required": ["login", "admin"], "additionalProperties": False},
    "score": {"type": "number", "minimum": -10, "maximum": 10},
    "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}},
    "required": ["title", "priority", "owner", "score", "note"], "additionalProperties": False}
LISTS = {"type": "object", "$defs": {"point": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["x", "y"], "additionalProperties": False}},
    "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
                   "label": {"type": "string", "maxLength": 10}},
    "required": ["points"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "nested": NESTED, "lists": LISTS}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query"], "additionalProperties": False}
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("search", SEARCH), ("noop", NOOP)]
PARAMS_OF = dict(TOOLS)
ANY_ARGS = TOOLS + [("anything", None)]  # None: any JSON object (unbounded: for the mask tests, not generation)


def check(instance, schema) -> None:
    """``instance`` follows ``schema`` (jsonschema's verdict, or by hand for the keywords the tests use)."""
    if _validate is not None:
        _validate(instance, schema)
        return
    _by_hand(instance, schema, schema)


def _by_hand(x, s, root) -> None:  # pragma: no cover - only without jsonschema
    if "$ref" in s:
        return _by_hand(x, root["$defs"][s["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in s:
        errors = []
        for sub in s["anyOf"]:
            try:
                return _by_hand(x, sub, root)
            except AssertionError as e:
                errors.append(e)
        raise AssertionError(errors)
    if "enum" in s:
        assert x in s["enum"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = s.get("type")
    if t in types:
        assert isinstance(x, types[t])
    if t in ("integer", "number"):
        assert isinstance(x, (int, float)) and not isinstance(x, bool) and (t == "number" or isinstance(x, int))
        assert s.get("minimum", -1e300) <= x <= s.get("maximum", 1e300)
    if t == "string":
        assert len(x) <= s.get("maxLength", 10**9)
        if "pattern" in s:
            import re
            assert re.search(s["pattern"], x)
    if t == "array":
        assert s.get("minItems", 0) <= len(x) <= s.get("maxItems", 10**9)
        for item in x:
            _by_hand(item, s.get("items", {}), root)
    if t == "object":
        assert set(s.get("required", [])) <= set(x)
        if s.get("additionalProperties") is False:
            assert set(x) <= set(s.get("properties", {}))
        for k, v in x.items():
            _by_hand(v, s.get("properties", {}).get(k, {}), root)


def check_calls(text: str, allowed: dict, only_calls: bool = True) -> list:
    """The calls in ``text``: at least one, each of an allowed tool with arguments that follow its parameters;
    ``only_calls``: nothing else in the text."""
    calls = HERMES.reply_calls(text)
    assert calls and text.count("<tool_call>") == len(calls), text
    if only_calls:
        assert HERMES.reply_content(text) == "", text
    for call in calls:
        assert call.function.name in allowed, text
        args = json.loads(call.function.arguments)
        check(args, allowed[call.function.name] or {"type": "object"})
    return calls


@pytest.fixture(scope="module")
def llm():
    return LLM(random_model_dir(), device="cpu", max_num_batched_tokens=512, num_pages=512)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


# --- the engine: outputs follow the grammar ---------------------------------------------------------------
def test_json_schema_outputs_parse_and_validate_over_schemas_and_seeds(llm):
    names, params = [], []
    for name, schema in SCHEMAS.items():
        for seed in range(4):
            names.append(name)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                         structured=StructuredSpec.json_schema(schema)))
    for seed in range(6):  # any object: its keys are strings of any length, so some run out of tokens
        names.append("object")
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                     structured=StructuredSpec.json_object()))
    outs = llm.generate(["Describe it as JSON:"] * len(params), params)
    for name, out in zip(names, outs):
        if name == "object" and out.finish_reason == "length":
            continue
        assert out.finish_reason == "stop", (name, out.text)
        check(json.loads(out.text), SCHEMAS.get(name, {"type": "object"}))
    assert sum(n == "object" and o.finish_reason == "stop" for n, o in zip(names, outs)) >= 2
    unconstrained = llm.generate(["Describe it as JSON:"], SamplingParams(temperature=1.0, seed=0, max_tokens=40))[0]
    with pytest.raises(ValueError):
        json.loads(unconstrained.text)  # the model alone emits garbage


def test_fifty_seeded_requests_on_the_embedded_model_always_follow_the_schema_or_call_a_tool():
    """The trained embedded model (not the random one) at temperature 1: 50 seeded strict json_schema requests
    each parse and validate, and 50 seeded ``tool_choice: required`` requests each make a valid call. The
    schemas bound their numbers (``nested``'s unbounded ``score`` lets this model write zeros until max_tokens:
    a JSON grammar allows any number of digits)."""
    llm = LLM(embedded_model_dir(), device="cpu", max_num_batched_tokens=512, num_pages=1024, max_num_seqs=64)
    schemas = [(name, schema) for name, schema in SCHEMAS.items() if name != "nested"]
    names = [schemas[seed % len(schemas)][0] for seed in range(50)]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                             structured=StructuredSpec.json_schema(SCHEMAS[name]))
              for seed, name in enumerate(names)]
    for name, out in zip(names, llm.generate(["Describe the person as JSON:"] * 50, params)):
        assert out.finish_reason == "stop", (name, out.text)
        check(json.loads(out.text), SCHEMAS[name])
    required = StructuredSpec.tool_calls(TOOLS)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured=required) for seed in range(50)]
    for out in llm.generate(["Call a tool."] * 50, params):
        assert out.finish_reason == "stop", out.text
        check_calls(out.text, PARAMS_OF)


def test_tool_calls_required_named_and_one(llm):
    specs = {"required": StructuredSpec.tool_calls(TOOLS),
             "one": StructuredSpec.tool_calls(TOOLS, max_calls=1),
             "named": StructuredSpec.tool_calls([("search", SEARCH)], max_calls=1)}
    keys, params = [], []
    for key, spec in specs.items():
        for seed in range(4):
            keys.append(key)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured=spec))
    for key, out in zip(keys, llm.generate(["Call a tool."] * len(params), params)):
        assert out.finish_reason == "stop", (key, out.text)
        allowed = {"search": SEARCH} if key == "named" else PARAMS_OF
        calls = check_calls(out.text, allowed)
        if key != "required":
            assert len(calls) == 1


def test_lazy_tool_calls_leave_text_free_and_constrain_each_call(llm, tokenizer):
    spec = StructuredSpec.tool_calls(TOOLS, required=False)
    prefix = tokenizer.encode("Let me check. ", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(
        "<tool_call>")]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured=spec, forced_token_ids=prefix)
              for s in range(4)]
    for out in llm.generate(["Call a tool."] * 4, params):
        assert out.text.startswith("Let me check. <tool_call>")
        head, _, rest = out.text.partition("</tool_call>")
        check_calls(head + "</tool_call>", PARAMS_OF, only_calls=False)
        if out.finish_reason == "stop":
            check_calls(out.text, PARAMS_OF, only_calls=False)
    free = llm.generate(["Hi"], SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured=spec))[0]
    assert HERMES.reply_content(free.text)  # text alone is allowed
    # the trigger spelled out in plain text (not the tag's token) is refused in free text
    so, m = llm.engine.structured_outputs, llm.engine.structured_outputs.matcher(spec)
    for t in tokenizer.encode("a <tool_call", add_special_tokens=False):
        assert m.consume_token(t)
    assert tokenizer.encode(">", add_special_tokens=False)[0] not in _allowed(so, m)


def test_a_plain_text_trigger_starts_a_constrained_call(llm, tokenizer):
    """Another call syntax, whose trigger is text rather than a token: the free text ends at its first
    occurrence and the call must follow."""
    spec = StructuredSpec.tool_calls(TOOLS, required=False, trigger="<fn", begin="<fn {name}>", end="</fn>")
    forced = tokenizer.encode("ok <fn", add_special_tokens=False)
    outs = llm.generate(["?"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=spec,
                                                   forced_token_ids=forced) for s in range(3)])
    for out in outs:
        head, call = out.text.split("<fn ", 1)
        name, args = call.split(">", 1)
        args = args.split("</fn>", 1)[0]
        assert head == "ok " and json.loads(name) in PARAMS_OF, out.text
        check(json.loads(args), PARAMS_OF[json.loads(name)])


def test_content_or_calls(llm):
    spec = StructuredSpec.tool_calls(TOOLS, required=False, content=PERSON)
    outs = llm.generate(["?"] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured=spec)
                                    for s in range(6)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        if out.text.startswith("<tool_call>"):
            check_calls(out.text, PARAMS_OF)
        else:
            check(json.loads(out.text), PERSON)


def test_regex_and_ebnf(llm):
    regex = StructuredSpec.regex(r"(yes|no), [0-9]{2}")
    ebnf = StructuredSpec.ebnf('root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+')
    lark = StructuredSpec.ebnf('start: "<" NAME ">"\nNAME: /[xyz]{1,4}/')
    outs = llm.generate(["?"] * 9, [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured=spec)
                                    for spec in (regex, ebnf, lark) for s in range(3)])
    import re
    for i, out in enumerate(outs):
        pattern = [r"(yes|no), [0-9]{2}", r"\([a-c]+(,[a-c]+)*\)", r"<[xyz]{1,4}>"][i // 3]
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def test_grammar_end_stops_the_request_even_with_ignore_eos(llm):
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                       "required": ["ok"], "additionalProperties": False})
    out = llm.generate(["?"], SamplingParams(temperature=1.0, seed=3, max_tokens=50, ignore_eos=True,
                                             structured=spec))[0]
    assert out.finish_reason == "stop" and out.text in ('{"ok": true}', '{"ok": false}')
    assert llm.tokenizer.decode(out.token_ids) == out.text  # nothing after the closing brace


# --- the mask -----------------------------------------------------------------------------------------------
def _allowed(so: StructuredOutputs, matcher) -> set[int]:
    """Tokens left finite by the engine's mask for ``matcher``'s state."""
    logits = torch.zeros(1, so.vocab_size)
    apply_token_bitmask(logits, so.fill([matcher]), [0])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _library_allowed(matcher) -> set[int]:
    """llguidance's own answer (one byte per token: its logit-bias form, not the bitmask the engine reads)."""
    return {i for i, b in enumerate(matcher.deep_copy().compute_logit_bias()) if b}


@pytest.mark.parametrize("spec", [
    StructuredSpec.json_schema(PERSON), StructuredSpec.json_schema(LISTS), StructuredSpec.json_object(),
    StructuredSpec.tool_calls(ANY_ARGS), StructuredSpec.tool_calls(ANY_ARGS, required=False),
    StructuredSpec.tool_calls(TOOLS, required=False, trigger="<fn", begin="<fn {name}>", end="</fn>"),
    StructuredSpec.tool_calls(TOOLS, required=False, content=NESTED),
    StructuredSpec.regex(r"[a-f]{3,5}-[0-9]+"), StructuredSpec.ebnf('root ::= ("ab" | "c")+ "."')],
    ids=["person", "lists", "object", "calls", "lazy", "text-trigger", "content", "regex", "ebnf"])
def test_mask_equals_the_librarys_answer_along_random_walks(llm, spec):
    so = llm.engine.structured_outputs
    rng = random.Random(0)
    for walk in range(3):
        m = so.matcher(spec)
        for _ in range(40):
            ours = _allowed(so, m)
            assert ours == _library_allowed(m)
            assert ours and all(t < so.vocab_size for t in ours)
            for t in rng.sample(sorted(ours), min(5, len(ours))):  # an allowed token is accepted
                assert m.deep_copy().consume_token(t)
            if m.is_stopped():
                break
            assert m.consume_token(rng.choice(sorted(ours)))


def test_apply_token_bitmask_matches_a_direct_reading_on_any_rows():
    gen = torch.Generator().manual_seed(0)
    for vocab in (31, 32, 100, 512):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
        logits = torch.randn(5, vocab, generator=gen)
        out = logits.clone()
        apply_token_bitmask(out, bitmask, [4, 0, 2])
        for r, row in enumerate([4, 0, 2]):
            for j in range(vocab):
                bit = (int(bitmask[r, j // 32]) >> (j % 32)) & 1
                assert out[row, j].item() == (logits[row, j].item() if bit else float("-inf"))
        assert torch.equal(out[[1, 3]], logits[[1, 3]])


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.5),
          SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0, seed=7)]


def test_the_sampler_never_picks_a_masked_token(llm):
    """Constrained rows in every sampling mode, their forbidden tokens given the largest logits; unconstrained
    rows in between are left as they were (greedy ones pick the raw argmax)."""
    so = llm.engine.structured_outputs
    specs = [StructuredSpec.json_schema(PERSON), StructuredSpec.tool_calls(TOOLS), StructuredSpec.regex("[0-9]+x")]
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    sampler = Sampler()
    for trial in range(60):
        matchers = [so.matcher(specs[trial % 3]) for _ in PARAMS]
        for m in matchers:  # a random state along the grammar
            for _ in range(rng.randrange(0, 12)):
                allowed = sorted(_library_allowed(m))
                if m.is_stopped():
                    break
                m.consume_token(rng.choice(allowed))
        live = [m if not m.is_stopped() else None for m in matchers]
        params = PARAMS + [SamplingParams(temperature=0.0)] * 2  # two unconstrained rows
        rows = live + [None, None]
        logits = torch.randn(len(rows), so.vocab_size, generator=gen)
        allowed = [_library_allowed(m) if m is not None else None for m in rows]
        for i, a in enumerate(allowed):
            if a is not None:
                forbidden = [t for t in range(so.vocab_size) if t not in a]
                logits[i, forbidden] += 20.0
        gens = [make_generator(p.seed, "cpu") for p in params]
        out = sampler.sample(logits, params, gens, masks=so.step_masks(rows)).token_ids
        for i, (t, a) in enumerate(zip(out, allowed)):
            if a is not None:
                assert t in a, (trial, i, params[i])
        assert out[-2:] == logits[-2:].argmax(-1).tolist()


# --- the engine: batches, windows, errors ---------------------------------------------------------------------
def test_unconstrained_requests_are_unchanged_by_constrained_ones_in_their_batch(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    prompts = ["The river", "Old trees"]
    alone = [o.token_ids for o in llm.generate(prompts, plain)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=80, structured=StructuredSpec.json_schema(PERSON)),
                   SamplingParams(temperature=1.0, seed=2, max_tokens=80, structured=StructuredSpec.tool_calls(TOOLS))]
    mixed = llm.generate([prompts[0], "A", prompts[1], "B"], [plain[0], constrained[0], plain[1], constrained[1]])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    check(json.loads(mixed[1].text), PERSON)


def _run_engine(decode_steps: int, requests) -> tuple[list[list[int]], list[int]]:
    engine = LLMEngine(EngineConfig(random_model_dir(), device="cpu", num_pages=256, decode_steps=decode_steps))
    ids = [engine.add_request(p, params) for p, params in requests]
    done, windows = {}, []
    while engine.has_unfinished():
        constrained_running = any(r.grammar is not None for r in engine.scheduler.running)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if engine.last_step is not None:
            windows.append((engine.last_step.decode_steps, constrained_running))
    return [done[i] for i in ids], windows


def test_decode_windows_give_the_single_step_outputs_and_skip_constrained_batches():
    requests = [("Hello", SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured=spec))
                for s, spec in enumerate([StructuredSpec.json_schema(NESTED), StructuredSpec.tool_calls(TOOLS)])]
    requests += [("World", SamplingParams(temperature=1.0, seed=9, max_tokens=120, ignore_eos=True)),
                 ("Again", SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))]
    single, _ = _run_engine(1, requests)
    windowed, steps = _run_engine(4, requests)
    assert windowed == single
    assert all(k == 1 for k, constrained in steps if constrained)  # a constrained batch takes single steps
    assert any(k == 4 for k, constrained in steps if not constrained)  # the rest still run windows


def test_bad_specs_and_forced_tokens_are_typed_errors_naming_the_field(llm, tokenizer):
    engine = llm.engine
    for spec in (StructuredSpec.json_schema({"type": "strin"}), StructuredSpec.regex("a(b"),
                 StructuredSpec.ebnf("root ::= missing")):
        with pytest.raises(InvalidSamplingParamsError, match=r"^structured "):
            engine.add_request("x", SamplingParams(structured=spec))
    with pytest.raises(InvalidSamplingParamsError, match=r"^structured kind"):
        StructuredSpec("xml", "<a/>")
    with pytest.raises(InvalidSamplingParamsError, match=r"^structured "):
        StructuredSpec.tool_calls([])
    with pytest.raises(InvalidSamplingParamsError, match=r"^structured "):
        SamplingParams(structured={"type": "json_object"})
    bad = tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidSamplingParamsError, match=r"^forced_token_ids\[0\]"):
        engine.add_request("x", SamplingParams(structured=StructuredSpec.json_object(), forced_token_ids=bad))
    assert not engine.has_unfinished()


def test_a_tool_calls_spec_written_with_only_the_first_keys_still_compiles(llm, tokenizer):
    """The wrapping and per-parameter keys are optional in a spec's JSON: one written without them (as before
    they existed) compiles to the Hermes calls it always meant."""
    body = {"tools": [{"name": "search", "parameters": SEARCH}], "required": True, "max_calls": 1, "content": None,
            "begin": '<tool_call>\n{"name": {name}, "arguments": ', "end": "}\n</tool_call>", "separator": "\n",
            "trigger": "<tool_call>"}
    spec = StructuredSpec("tool_calls", json.dumps(body))
    out = llm.generate(["Call:"], SamplingParams(temperature=1.0, seed=0, max_tokens=200, structured=spec))[0]
    assert out.finish_reason == "stop"
    check_calls(out.text, {"search": SEARCH})


def test_compiled_grammars_are_cached_by_spec(llm):
    so = llm.engine.structured_outputs
    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}}
    before = so.num_compiled
    for _ in range(3):
        llm.generate(["?"], SamplingParams(max_tokens=4, structured=StructuredSpec.json_schema(dict(schema))))
    assert so.num_compiled == before + 1


# --- the OpenAI route and chain turns, through the official client ------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": SEARCH}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_openai_json_schema_and_json_object_round_trip(client, model):
    for seed in range(3):
        done = client.chat.completions.create(
            model=model, messages=ASK, temperature=1.0, seed=seed, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        assert done.choices[0].finish_reason == "stop"
        check(json.loads(done.choices[0].message.content), PERSON)
    done = client.chat.completions.create(model=model, messages=ASK, temperature=1.0, seed=4, max_tokens=300,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(done.choices[0].message.content), dict)


class Point(BaseModel):
    x: int
    y: int
    label: str


def test_openai_parse_returns_the_model_instance(client, model):
    done = client.chat.completions.parse(model=model, messages=ASK, temperature=1.0, seed=1, max_tokens=300,
                                         response_format=Point)
    assert isinstance(done.choices[0].message.parsed, Point)


def test_openai_tool_choice_required_and_named_return_tool_calls(client, model):
    for seed in range(3):
        done = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL],
                                              tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "search")
            check(json.loads(call.function.arguments), PARAMS_OF[call.function.name])
    named = {"type": "function", "function": {"name": "search"}}
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL], tool_choice=named, temperature=1.0,
                  seed=5, max_tokens=300, parallel_tool_calls=False)
    done = client.chat.completions.create(**kwargs)
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "search"
    check(json.loads(call.function.arguments), SEARCH)
    streamed = [c for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices]
    calls = [tc for c in streamed if c.delta.tool_calls for tc in c.delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("search", call.function.arguments)]
    assert streamed[-1].finish_reason == "tool_calls"


def test_openai_auto_with_a_strict_tool_constrains_a_started_call(client, model, tokenizer):
    forced = tokenizer.encode("Checking. ", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<tool_call>")]
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    done = client.chat.completions.create(model=model, messages=ASK, tools=[strict], temperature=1.0, seed=2,
                                          max_tokens=200, extra_body={"forced_token_ids": forced})
    message = done.choices[0].message
    assert message.content.startswith("Checking.") and message.tool_calls
    check(json.loads(message.tool_calls[0].function.arguments), WEATHER)


def test_openai_invalid_schema_is_a_400_naming_response_format(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "format": "no-such-format"}}}}})
    assert (err.value.status_code, err.value.param) == (400, "response_format")
    assert "no-such-format" in err.value.message


def test_chain_turns_take_response_format_and_tool_choice(server, client, model):
    http = httpx.Client(base_url=server.url, timeout=120)
    chain = http.post("/v1/chains", json={"tools": [WEATHER_TOOL, SEARCH_TOOL]})
    assert chain.status_code == 201, chain.text
    cid = chain.json()["id"]

    def turn(content: str, sampling: dict) -> dict:
        r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": content}],
                                                        "sampling": {"temperature": 1.0, "seed": 3,
                                                                     "max_tokens": 300, **sampling}})
        assert r.status_code == 200, r.text
        return r.json()

    first = turn("Weather?", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    [call] = first["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    check(json.loads(call["function"]["arguments"]), WEATHER)
    r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [
        {"role": "tool", "tool_call_id": call["id"], "content": "18C"}, {"role": "user", "content": "As JSON?"}],
        "sampling": {"temperature": 1.0, "seed": 4, "max_tokens": 300, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}})
    assert r.status_code == 200, r.text
    check(json.loads(r.json()["message"]["content"]), PERSON)
    bad = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "x"}],
                                                      "sampling": {"tool_choice": {"type": "function",
                                                                                   "function": {"name": "nope"}}}})
    assert bad.status_code == 400 and "sampling.tool_choice" in bad.text
    # the OpenAI route's chain_id extension carries them to the turn
    done = client.chat.completions.create(
        model=model, extra_body={"chain_id": cid}, tool_choice="required", temperature=1.0, seed=6, max_tokens=300,
        messages=_history(http, cid) + [{"role": "user", "content": "Search it."}])
    assert done.choices[0].finish_reason == "tool_calls"
    for c in done.choices[0].message.tool_calls:
        check(json.loads(c.function.arguments), PARAMS_OF[c.function.name])


def _history(http: httpx.Client, cid: str) -> list[dict]:
    """The chain's messages as a client would send them back (its assistant messages as generated)."""
    chain = http.get(f"/v1/chains/{cid}").json()
    messages = []
    for t in chain["turns"]:
        messages += [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id")} for m in t["messages"]]
        messages.append({"role": "assistant", "content": t["message"]["content"]})
    return messages


# --- the benchmark behind the library choice ------------------------------------------------------------------
def test_grammar_mask_benchmark_rows():
    from benchmarks.grammar_mask import WORKLOADS, main

    try:
        import xgrammar  # noqa: F401 - only the benchmark's comparison needs it
        libraries = "xgrammar,llguidance"
    except ImportError:
        libraries = "llguidance"
    rows = main(["--vocab", "embedded", "--libraries", libraries, "--repeat", "1", "--compile-repeat", "1",
                 "--batch", "2"])
    assert len(rows) == len(libraries.split(",")) * (len(WORKLOADS) + 1)
    for r in rows:
        assert r["vocab"] == 512 and r["tokens"] > 10
        assert all(r[k] > 0 for k in ("fill_us", "fill_p50_us", "fill_p99_us", "accept_us", "compile_ms",
                                      "matcher_us", "batch_fill_us", "apply_us"))
