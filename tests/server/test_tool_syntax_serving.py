"""The server on a GLM-4.7-Flash (MLA) checkpoint whose chat template speaks another family's tool-call syntax:
GLM's ``<arg_key>`` pairs, Qwen3.5's ``<function=...>`` parameters, DeepSeek's call section. Through the official
``openai`` and ``anthropic`` clients: the model's calls (forced here, as a trained model would write them) come
back as tool calls with the arguments the tools' schemas type, streamed or not; the conversation re-sent with the
call and its result renders through the template (which iterates the arguments, or concatenates their text) and
resumes its chain, prefilling only the new tokens; ``tool_choice: "required"`` makes the random model write
calls of that syntax that read back as valid calls; history written elsewhere is imported in the syntax.

The templates are the embedded model's ChatML template with its tool-call rendering replaced by each family's,
written here from the families' own templates."""

from __future__ import annotations

import json
import re
import shutil

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from engine.tiny_tokenizer import CHAT_TEMPLATE
from tests.chat_styles import chain_record, forced_reply
from tests.live_servers import app_server, openai_client

# each family's rendering of one call of an assistant message (``tool_call``: the call's function)
CALL_RENDERING = {
    "glm45": "{{- '\\n<tool_call>' + tool_call.name + '\\n' }}{%- for k, v in tool_call.arguments.items() %}"
             "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + "
             "'</arg_value>\\n' }}{%- endfor %}{{- '</tool_call>' }}",
    "qwen3_coder": "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                   "{%- for k, v in tool_call.arguments | items %}{{- '<parameter=' + k + '>\\n' + "
                   "(v if v is string else v | tojson) + '\\n</parameter>\\n' }}{%- endfor %}"
                   "{{- '</function>\\n</tool_call>' }}",
    "deepseek": "{%- if loop.first %}{{- '<｜tool▁calls▁begin｜>' }}{%- endif %}{{- '<｜tool▁call▁begin｜>' + "
                "tool_call.name + '<｜tool▁sep｜>' + tool_call.arguments + '<｜tool▁call▁end｜>' }}"
                "{%- if loop.last %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}",
    "kimi_k2": "{%- if loop.first %}{{- '<|tool_calls_section_begin|>' }}{%- endif %}{{- '<|tool_call_begin|>' + "
               "'functions.' + tool_call.name + ':' + (loop.index0 | string) + '<|tool_call_argument_begin|>' + "
               "tool_call.arguments + '<|tool_call_end|>' }}{%- if loop.last %}{{- '<|tool_calls_section_end|>' }}"
               "{%- endif %}",
}
# what the model writes for the call below, in each syntax (a bare "42" is a string: the schema says so)
WRITTEN = {
    "glm45": "Listing.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls -la</arg_value>\n<arg_key>timeout"
             "</arg_key>\n<arg_value>30</arg_value>\n<arg_key>note</arg_key>\n<arg_value>42</arg_value>\n</tool_call>",
    "qwen3_coder": "Listing.\n\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls -la\n</parameter>\n"
                   "<parameter=timeout>\n30\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n"
                   "</tool_call>",
    "deepseek": "Listing.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{\"cmd\": \"ls -la\", "
                "\"timeout\": 30, \"note\": \"42\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "Listing.<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
               "{\"cmd\": \"ls -la\", \"timeout\": 30, \"note\": \"42\"}<|tool_call_end|><|tool_calls_section_end|>",
}
ARGUMENTS = {"cmd": "ls -la", "timeout": 30, "note": "42"}
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string", "maxLength": 8},
                                     "timeout": {"type": "integer", "minimum": 1, "maximum": 99},
                                     "note": {"type": "string", "maxLength": 4}},
    "required": ["cmd", "timeout"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "List the files."}]


def _template(syntax: str) -> str:
    """The embedded ChatML template with the family's call rendering in place of Hermes'."""
    hermes = re.compile(r"\{\{- '\\n<tool_call>\\n\{\"name\": \"' \}\}.*?\{\{- '\}\\n</tool_call>' \}\}", re.S)
    assert len(hermes.findall(CHAT_TEMPLATE)) == 1
    return hermes.sub(lambda _: CALL_RENDERING[syntax], CHAT_TEMPLATE)


@pytest.fixture(scope="module", params=sorted(CALL_RENDERING))
def served(request, mla_dirs, tmp_path_factory):
    """(server, openai client, syntax, tokenizer) on a GLM-4.7-Flash tiny checkpoint speaking ``syntax``."""
    syntax = request.param
    root = tmp_path_factory.mktemp(syntax)
    model_dir = root / "glm"
    shutil.copytree(mla_dirs["glm4_moe_lite"], model_dir)
    (model_dir / "chat_template.jinja").write_text(_template(syntax))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with app_server(f"sqlite+aiosqlite:///{root / 'server.db'}", model=model_dir, model_name="glm") as server:
        yield server, openai_client(server.url), syntax, tokenizer


def _forced(tokenizer, text: str) -> list[int]:
    return forced_reply(tokenizer, text, "<|im_end|>")


def _call(client, tokenizer, syntax: str, messages: list, **kwargs):
    forced = _forced(tokenizer, WRITTEN[syntax])
    return client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0,
                                          max_tokens=len(forced) + 4, extra_body={"forced_token_ids": forced},
                                          **kwargs)


def test_the_models_call_comes_back_as_a_tool_call_with_typed_arguments(served):
    server, client, syntax, tokenizer = served
    r = _call(client, tokenizer, syntax, ASK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Listing."
    if syntax == "kimi_k2":  # the model's own id, which the template writes back
        assert choice.message.tool_calls[0].id == "functions.bash:0"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("bash", ARGUMENTS)]


def test_a_streamed_call_assembles_to_the_same_message(served):
    server, client, syntax, tokenizer = served
    forced = _forced(tokenizer, WRITTEN[syntax])
    stream = client.chat.completions.create(model="glm", messages=ASK + [{"role": "user", "content": "Stream."}],
                                            tools=[BASH], temperature=0, max_tokens=len(forced) + 4, stream=True,
                                            extra_body={"forced_token_ids": forced})
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Listing." and finish == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [("bash", ARGUMENTS)]


def test_the_resent_call_and_its_result_resume_thechain_record(served):
    """The client re-sends the call as it got it (arguments as JSON text) with the tool's result: the template
    renders it (a mapping for the templates that iterate it), the chain matches it in the syntax, and the next
    turn prefills only the result's tokens (and the previous turn's last token)."""
    server, client, syntax, tokenizer = served
    messages = ASK + [{"role": "user", "content": "Resume."}]
    first = _call(client, tokenizer, syntax, messages)
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": first.choices[0].message.content,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "a.py b.py"}]
    second = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0,
                                            max_tokens=3)
    chain_id = first.model_extra["chain"]["id"]
    assert second.model_extra["chain"]["id"] == chain_id
    turn = chain_record(server.url, chain_id)["turns"][-1]
    assert turn["resume_status"] == "resumed"
    assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
    appended = tokenizer.decode(turn["appended_token_ids"])
    assert "a.py b.py" in appended and "bash" not in appended  # the call was not rendered again


def test_the_anthropic_client_gets_a_tool_use_block(served):
    server, _, syntax, tokenizer = served
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    forced = _forced(tokenizer, WRITTEN[syntax])
    m = client.messages.create(model="glm", max_tokens=len(forced) + 4, system="You are a coding agent.",
                               messages=[{"role": "user", "content": "Anthropic: list the files."}],
                               tools=[{"name": "bash", "description": "Run a shell command.",
                                       "input_schema": BASH["function"]["parameters"]}],
                               extra_body={"agentrt_forced_token_ids": forced})
    assert m.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in m.content] == \
        [("text", "Listing."), ("tool_use", ARGUMENTS)]


def test_required_tool_choice_writes_calls_of_the_syntax(served):
    """The random model under ``tool_choice: "required"``: its calls read back, valid for the tool's schema (a
    syntax without a grammar: a 400 naming the field)."""
    server, client, syntax, tokenizer = served
    if syntax == "kimi_k2":
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="glm", messages=ASK, tools=[BASH], tool_choice="required")
        assert err.value.body["param"] == "tool_choice" and "kimi_k2" in err.value.body["message"]
        return
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(model="glm", messages=ASK + [{"role": "user", "content": f"Go {seed}."}],
                                           tools=[BASH], tool_choice="required", temperature=1.0, seed=seed,
                                           max_tokens=200)
        if r.choices[0].finish_reason == "length":
            continue
        finished += 1
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        for call in r.choices[0].message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "bash" and {"cmd", "timeout"} <= set(arguments) <= {"cmd", "timeout", "note"}
            assert isinstance(arguments["cmd"], str) and len(arguments["cmd"]) <= 8
            assert isinstance(arguments["timeout"], int) and 1 <= arguments["timeout"] <= 99
    assert finished


def test_history_written_elsewhere_is_imported_in_the_syntax(served):
    """A conversation whose assistant call this server never generated: the chain imports it as the model would
    have written it, so its turn reads back as that call."""
    server, client, syntax, tokenizer = served
    messages = ASK + [{"role": "user", "content": "Imported."},
                      {"role": "assistant", "content": "Listing.", "tool_calls": [
                          {"id": "call_x", "type": "function",
                           "function": {"name": "bash", "arguments": json.dumps(ARGUMENTS)}}]},
                      {"role": "tool", "tool_call_id": "call_x", "content": "a.py"}]
    r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
    imported = chain_record(server.url, r.model_extra["chain"]["id"])["turns"][0]["message"]
    assert imported["content"] == WRITTEN[syntax]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in imported["tool_calls"]] == \
        [("bash", ARGUMENTS)]
