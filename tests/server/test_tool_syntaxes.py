"""Tool-call syntaxes (agentrt.tool_syntax): each model family's calls read from its own markup, written back as
the model spells them, streamed by the same rules, found in a chat template, handed to templates in the form they
iterate, and forced by the grammar so that what a constrained model writes reads back as valid calls.

The expected markup is written here by hand from each family's chat template (GLM-4.5 to 4.7, Qwen3-Coder /
Qwen3.5, DeepSeek-V3.1): the parsers are checked against it, not against their own writer only.
"""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.chat import ChatRenderer
from agentrt.tool_syntax import SYNTAXES, ToolCallReader, by_name, detect
from engine import LLM, SamplingParams
from engine.structured_output import StructuredSpec
from engine.tiny_checkpoint import random_model_dir

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string", "maxLength": 10}, "timeout": {"type": "integer", "minimum": 0, "maximum": 99},
    "dry": {"type": "boolean"}, "env": {"type": "object", "properties": {"A": {"type": "string", "maxLength": 3}},
                                        "additionalProperties": False},
    "note": {"type": "string", "maxLength": 4}}, "required": ["cmd"],
    "additionalProperties": False}}}
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 12}, "line": {"type": "integer", "minimum": 1, "maximum": 99},
    "mode": {"enum": ["insert", "replace"]}}, "required": ["path", "line", "mode"],
    "additionalProperties": False}}}
TOOLS = [BASH, EDIT]
# the arguments: a string that spells a number and one that spells JSON stay strings where the schema says string
ARGUMENTS = {"cmd": "ls -la", "timeout": 30, "dry": True, "env": {"A": "1"}, "note": "42"}

# the same reply in each syntax, as the families' chat templates write an assistant message with one call
SPELLED = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la", "timeout": 30, "dry": true, '
              '"env": {"A": "1"}, "note": "42"}}\n</tool_call>',
    "glm45": "Checking.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls -la</arg_value>\n"
             "<arg_key>timeout</arg_key>\n<arg_value>30</arg_value>\n<arg_key>dry</arg_key>\n<arg_value>true"
             '</arg_value>\n<arg_key>env</arg_key>\n<arg_value>{"A": "1"}</arg_value>\n<arg_key>note</arg_key>\n'
             "<arg_value>42</arg_value>\n</tool_call>",
    "qwen3_coder": "Checking.\n\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls -la\n</parameter>\n"
                   "<parameter=timeout>\n30\n</parameter>\n<parameter=dry>\nTrue\n</parameter>\n<parameter=env>\n"
                   '{"A": "1"}\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>',
    "deepseek": "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{\"cmd\": \"ls -la\", "
                "\"timeout\": 30, \"dry\": true, \"env\": {\"A\": \"1\"}, \"note\": \"42\"}<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>",
    "kimi_k2": "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
               "{\"cmd\": \"ls -la\", \"timeout\": 30, \"dry\": true, \"env\": {\"A\": \"1\"}, \"note\": \"42\"}"
               "<|tool_call_end|><|tool_calls_section_end|>",
}
# the V3-0324 form of a DeepSeek call reads the same
DEEPSEEK_FENCED = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{\"cmd\": \"ls\"}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def _calls(calls) -> list[tuple[str, object]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_each_syntax_reads_its_familys_markup(name):
    reader = ToolCallReader(by_name(name), TOOLS)
    text = SPELLED[name]
    assert _calls(reader.calls_in(text)) == [("bash", ARGUMENTS)]
    assert reader.without_calls(text) == "Checking."
    assert reader.without_calls("no calls here") == "no calls here" and reader.calls_in("no calls here") == []


@pytest.mark.parametrize("name", ["glm45", "qwen3_coder"])
def test_bare_values_follow_the_schema(name):
    """A bare value is text where the parameter is a string, JSON where it is not; with no schema, JSON where it
    spells some (so the tools decide, not the text)."""
    text = SPELLED[name]
    untyped = _calls(ToolCallReader(by_name(name)).calls_in(text))[0][1]
    assert untyped["note"] == 42 and untyped["cmd"] == "ls -la"  # no schema: "42" reads as a number
    typed = _calls(ToolCallReader(by_name(name), TOOLS).calls_in(text))[0][1]
    assert typed["note"] == "42" and typed["timeout"] == 30 and typed["dry"] is True and typed["env"] == {"A": "1"}


def test_kimi_calls_keep_the_models_ids():
    """The template writes a call's id back (and into its result): the call keeps the id the model wrote."""
    reader = ToolCallReader(by_name("kimi_k2"))
    two = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:3<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_call_begin|>functions.ls:4<|tool_call_argument_begin|>{\"d\": 1}<|tool_call_end|>"
           "<|tool_calls_section_end|>")
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in reader.calls_in(two)] == \
        [("functions.read_file:3", "read_file", {}), ("functions.ls:4", "ls", {"d": 1})]


def test_deepseek_reads_the_fenced_form_and_several_calls():
    reader = ToolCallReader(by_name("deepseek"))
    assert _calls(reader.calls_in(DEEPSEEK_FENCED)) == [("bash", {"cmd": "ls"})]
    two = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert _calls(reader.calls_in(two)) == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_malformed_blocks_are_markup_without_calls(name):
    broken = {"hermes": '<tool_call>\n{"name": "bash", "arguments": {]}\n</tool_call>',
              "glm45": "<tool_call>bash\n<arg_key>cmd</arg_key>\n</tool_call>",
              "qwen3_coder": "<tool_call>\n<function=bash>\n<parameter=cmd>\nls\n</function>\n</tool_call>",
              "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
                          "<｜tool▁calls▁end｜>",
              "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
                         "{\"cmd\"<|tool_call_end|><|tool_calls_section_end|>"}[name]
    reader = ToolCallReader(by_name(name), TOOLS)
    assert reader.calls_in("Before " + broken + " after") == []
    assert reader.without_calls("Before " + broken + " after") == "Before  after"


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_spelled_calls_read_back(name):
    """An assistant message written as the model generates it (imported history) reads back as itself."""
    syntax = by_name(name)
    calls = [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps(ARGUMENTS)}},
             {"id": "c2", "type": "function", "function": {"name": "edit", "arguments":
                                                           '{"path": "a.py", "line": 3, "mode": "insert"}'}}]
    reader = ToolCallReader(syntax, TOOLS)
    for content in ("Checking.", ""):
        text = syntax.spell(content, calls)
        assert _calls(reader.calls_in(text)) == [("bash", ARGUMENTS), ("edit", {"path": "a.py", "line": 3,
                                                                                 "mode": "insert"})], text
        assert reader.without_calls(text) == content
    assert syntax.spell("Just text.", []) == "Just text."


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_argument_spans_cover_exactly_the_arguments(name):
    syntax = by_name(name)
    text = SPELLED[name]
    (parsed,) = ToolCallReader(syntax, TOOLS).parsed(text)
    a, b = parsed.arguments
    spelled = text[a:b]
    assert "bash" not in spelled and "ls -la" in spelled and "42" in spelled
    first, last = {"hermes": ('{"cmd"', "}}"), "glm45": ("<arg_key>", "</arg_value>\n</tool_call>"),
                   "qwen3_coder": ("<parameter=", "\n</function>"),
                   "deepseek": ('{"cmd"', "<｜tool▁call▁end｜>"), "kimi_k2": ('{"cmd"', "<|tool_call_end|>")}[name]
    end = text.rindex(last) + (1 if name == "hermes" else 0) + (len("</arg_value>") if name == "glm45" else 0)
    assert spelled == text[text.index(first):end]


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "<tool_", "text ", "\n", " "],
    "glm45": ["<tool_call>", "</tool_call>", "f", "<arg_key>a</arg_key>", "<arg_value>1</arg_value>", "<tool_",
              "text ", "\n", " "],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "\n1\n",
                    "</parameter>", "<func", "text ", "\n", " "],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>",
                 '{"a": 1}', "<｜tool▁call▁end｜>", "<｜tool", "text ", "\n", " "],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>functions.f:0",
                "<|tool_call_argument_begin|>", '{"a": 1}', "<|tool_call_end|>", "<|tool", "text ", "\n", " "],
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streams_equal_the_whole_text_rules_on_any_split(name, data):
    reader = ToolCallReader(by_name(name))
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=14)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    stream, released, calls = reader.stream(), [], []
    for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
        content, new = stream.feed(piece)
        released.append(content)
        calls += new
    content, new = stream.finish()
    assert "".join(released) + content == reader.without_calls(text)
    assert _calls(calls + new) == _calls(reader.calls_in(text))


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_a_stream_releases_a_call_when_its_block_closes(name):
    text = SPELLED[name]
    stream = ToolCallReader(by_name(name), TOOLS).stream()
    content, calls = stream.feed(text[:-len(by_name(name).close)])
    assert content == "Checking." and calls == []  # the text before the call is out; the block is held
    assert _calls(stream.feed(by_name(name).close)[1]) == [("bash", ARGUMENTS)]


# --- which syntax a chat template speaks, and what it is handed -------------------------------------------
TEMPLATE_SIGNS = {
    "glm45": "{{ '<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>"
             "{% endfor %}",
    "qwen3_coder": "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ k }}>",
    "deepseek": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name']}}",
    "hermes": '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}',
    "kimi_k2": "<|tool_calls_section_begin|>{% for tc in message.tool_calls %}<|tool_call_begin|>{{ tc.id }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_SIGNS))
def test_the_syntax_is_read_from_the_chat_template(name):
    assert detect(TEMPLATE_SIGNS[name]).name == name
    assert detect(None).name == detect("{{ messages }}").name == "hermes"
    assert detect({"default": "{{ messages }}", "tool_use": TEMPLATE_SIGNS[name]}).name == name
    assert set(SYNTAXES) == set(TEMPLATE_SIGNS)
    with pytest.raises(ValueError, match="known: hermes"):
        by_name("nope")


# a GLM-style template reduced to what matters: it iterates each call's arguments as a mapping
GLM_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% for tc in m.tool_calls or [] %}"
            "<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}"
            "</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>"
            "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_templates_that_iterate_arguments_get_a_mapping():
    """The API carries arguments as JSON text; a template that iterates them (GLM's, Qwen3.5's) gets the
    mapping, one that writes them (DeepSeek's) keeps the text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(random_model_dir())
    tokenizer.chat_template = GLM_LIKE
    history = [{"role": "user", "content": "run it"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "bash", "arguments": '{"cmd": "ls", "n": 2}'}}]}]
    renderer = ChatRenderer(tokenizer, [])
    assert renderer.tool_syntax.name == "glm45"
    assert "<arg_key>cmd</arg_key><arg_value>ls</arg_value><arg_key>n</arg_key><arg_value>2</arg_value>" in \
        renderer.render(history, None)
    with pytest.raises(jinja2.exceptions.UndefinedError):  # what the template makes of the text itself
        ChatRenderer(tokenizer, [], by_name("deepseek")).render(history, None)


# --- the grammar: forced calls in each syntax read back as valid calls ----------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(random_model_dir(), device="cpu", max_num_batched_tokens=512, num_pages=512)


def _valid(arguments: dict, schema: dict) -> None:
    properties = schema["properties"]
    assert set(schema.get("required", [])) <= set(arguments) <= set(properties), arguments
    for key, value in arguments.items():
        kind = properties[key].get("type")
        expected = {"string": str, "integer": int, "boolean": bool, "object": dict}.get(kind)
        if expected is not None:
            assert isinstance(value, expected) and (kind != "integer" or not isinstance(value, bool)), (key, value)
        if "enum" in properties[key]:
            assert value in properties[key]["enum"]
        if "maximum" in properties[key]:
            assert properties[key]["minimum"] <= value <= properties[key]["maximum"]
        if "maxLength" in properties[key]:
            assert len(value) <= properties[key]["maxLength"]


FORCEABLE = sorted(name for name, syntax in SYNTAXES.items() if syntax.grammar is not None)


@pytest.mark.parametrize("name", FORCEABLE)
def test_forced_calls_in_each_syntax_read_back_as_valid_calls(llm, name):
    """A random model under ``tool_choice`` "required" (and a named tool, one call) writes garbage unconstrained;
    every constrained output here reads back, under the syntax's own reader, as calls of the tools whose
    arguments follow their schemas, with nothing else in the text."""
    syntax = by_name(name)
    reader = ToolCallReader(syntax, TOOLS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    specs = [StructuredSpec.tool_calls([(n, s) for n, s in schemas.items()], **syntax.grammar),
             StructuredSpec.tool_calls([("edit", schemas["edit"])], max_calls=1, **syntax.grammar)]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured=spec)
              for spec in specs for seed in range(4)]
    outs = llm.generate(["Call a tool:"] * len(params), params)
    for i, out in enumerate(outs):
        if out.finish_reason == "length":  # free strings may run long; a finished output must be whole calls
            continue
        calls = reader.calls_in(out.text)
        assert calls and reader.without_calls(out.text) == "", out.text
        if i >= 4:
            assert [c.function.name for c in calls] == ["edit"], out.text
        for call in calls:
            _valid(json.loads(call.function.arguments), schemas[call.function.name])
    assert sum(out.finish_reason == "stop" for out in outs) >= 4


@pytest.mark.parametrize("name", FORCEABLE)
def test_a_strict_tools_started_call_is_constrained_in_each_syntax(llm, name):
    """``tool_choice`` "auto" with a strict tool: free text, but a call that starts (forced here by its
    opening) is whole and valid."""
    syntax = by_name(name)
    reader = ToolCallReader(syntax, TOOLS)
    schema = EDIT["function"]["parameters"]
    spec = StructuredSpec.tool_calls([("edit", schema)], required=False, **syntax.grammar)
    opening = syntax.grammar.get("open") or syntax.grammar.get("begin", "<tool_call>").split("{")[0]
    forced = llm.tokenizer.encode(opening, add_special_tokens=False)
    outs = llm.generate(["Go:"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=400, structured=spec,
                                                     forced_token_ids=forced) for s in range(3)])
    finished = [out for out in outs if out.finish_reason == "stop"]
    assert finished
    for out in finished:
        calls = reader.calls_in(out.text)
        assert calls, out.text
        for call in calls:
            _valid(json.loads(call.function.arguments), schema)


def test_a_syntax_without_a_grammar_refuses_forced_calls_naming_the_field():
    from litestar.exceptions import HTTPException

    from agentrt.structured_spec import structured_spec

    syntax = by_name("kimi_k2")
    assert FORCEABLE == sorted(set(SYNTAXES) - {"kimi_k2"})
    strict = [{**BASH, "function": {**BASH["function"], "strict": True}}]
    for choice, tools, field in (("required", TOOLS, "tool_choice"), ("auto", strict, "tools[0].function.strict")):
        with pytest.raises(HTTPException) as err:
            structured_spec(None, choice, tools, None, syntax)
        assert err.value.status_code == 400 and field in str(err.value.extra) + str(err.value.detail), err.value
    assert structured_spec(None, "auto", TOOLS, None, syntax) == (None, "response_format")  # free text: no grammar
