"""A DeepSeek-V3.1-style chat (tests/chat_styles.py: a reply ends with ``<｜end▁of▁sentence｜>``, no generation
prompt after tool output, calls in a ``<｜tool▁calls▁begin｜>`` section whose arguments the template concatenates
as JSON text) on a tiny DeepSeek-V3 checkpoint, through the ``openai`` client as an agent loop runs it: the calls
come back as tool calls, each re-sent turn resumes the chain and prefills only its new tokens, and the chain's log
is token for token the template's own rendering of the conversation, also for history imported from elsewhere.
The replies are forced (``forced_token_ids``) as a trained model would write them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.chat_styles import (chain_record, forced_reply, make_deepseek_style_checkpoint, prompt_log,
                               styled_server)
from tests.live_servers import app_server, openai_client

BASH = {"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
SYSTEM = {"role": "system", "content": "You are a coding agent."}
CALL = 'Listing.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{"cmd": "ls"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
END = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def deepseek(mla_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-style")
    model_dir = make_deepseek_style_checkpoint(root, mla_dirs["deepseek_v3"])
    with styled_server(root, model_dir, "ds") as served:
        yield served


def _forced(tokenizer, text: str) -> list[int]:
    return forced_reply(tokenizer, text, END)


def test_an_agent_loop_resumes_its_chain_token_for_token(deepseek):
    server, client, tokenizer = deepseek
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    forced = _forced(tokenizer, CALL)
    r = client.chat.completions.create(model="ds", messages=messages, tools=[BASH], temperature=0,
                                       max_tokens=len(forced) + 2, extra_body={"forced_token_ids": forced})
    message = r.choices[0].message
    assert message.content == "Listing." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("bash", {"cmd": "ls"})]
    chain_id = r.model_extra["chain"]["id"]
    messages += [{"role": "assistant", "content": message.content, "tool_calls": [
                     {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                     for c in message.tool_calls]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.py"}]
    forced = _forced(tokenizer, "There is a.py.")
    r = client.chat.completions.create(model="ds", messages=messages, tools=[BASH], temperature=0,
                                       max_tokens=len(forced) + 2, extra_body={"forced_token_ids": forced})
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Thanks."}]
    r = client.chat.completions.create(model="ds", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
    assert r.model_extra["chain"]["id"] == chain_id
    chain = chain_record(server.url, chain_id)
    log, turns = prompt_log(chain), chain["turns"]
    for turn in turns[1:]:
        assert turn["resume_status"] == "resumed"
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
    rendered = tokenizer.apply_chat_template(messages, tools=[BASH], tokenize=False, add_generation_prompt=True)
    assert log == tokenizer.encode(rendered, add_special_tokens=False)


def test_history_from_elsewhere_is_imported_token_for_token(deepseek):
    server, client, tokenizer = deepseek
    messages = [SYSTEM, {"role": "user", "content": "Imported: list the files."},
                {"role": "assistant", "content": "Listing.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    r = client.chat.completions.create(model="ds", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
    log = prompt_log(chain_record(server.url, r.model_extra["chain"]["id"]))
    rendered = tokenizer.apply_chat_template(messages, tools=[BASH], tokenize=False, add_generation_prompt=True)
    assert log == tokenizer.encode(rendered, add_special_tokens=False)


def test_a_stateless_server_renders_the_calls_as_json_text(mla_dirs, tmp_path):
    """Without implicit chains the whole conversation is rendered: the template, which concatenates a call's
    arguments, gets them as the JSON text the API carries."""
    model_dir = make_deepseek_style_checkpoint(tmp_path, mla_dirs["deepseek_v3"])
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'server.db'}", model=model_dir, model_name="ds",
                    implicit_chains=False) as server:
        client = openai_client(server.url)
        messages = [SYSTEM, {"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": "Listing.", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
        r = client.chat.completions.create(model="ds", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rendered = tokenizer.apply_chat_template(messages, tools=[BASH], tokenize=False, add_generation_prompt=True)
        assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
