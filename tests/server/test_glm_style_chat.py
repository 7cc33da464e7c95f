"""A GLM-style chat (tests/chat_styles.py: tags as special tokens, no end-of-message token, earlier reasoning
emptied to ``<think></think>``, ``<arg_key>`` calls) through the server, as an agent loop runs it with the
official clients: the tags stay in the replies' text so the reasoning and the calls are read; each re-sent turn
resumes the chain and prefills only its new tokens, never a second copy of the role tag the model stopped on; the
reasoning the template empties leaves the KV; history from elsewhere is imported token for token as the template
writes it; Anthropic's ``clear_tool_inputs`` prunes a cleared call's ``<arg_key>`` pairs. The replies are forced
(``forced_token_ids``) as a trained model would write them."""

from __future__ import annotations

import copy
import json

import anthropic
import pytest
from transformers import AutoTokenizer

from tests.chat_styles import chain_record, forced_reply, make_glm_style_checkpoint, prompt_log, styled_server
from tests.live_servers import app_server, openai_client

BASH = {"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "n": {"type": "integer"}}, "required": ["cmd"]}}}
SYSTEM = {"role": "system", "content": "You are a coding agent."}
CALL = "\n<think>Plan it.</think>\nListing.\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\n" \
       "<arg_key>n</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
ANSWER = "\n<think>Read it.</think>\nThere is a.py."


@pytest.fixture(scope="module")
def glm(mla_dirs, tmp_path_factory):
    """(server, openai client, tokenizer) on the GLM-style checkpoint."""
    root = tmp_path_factory.mktemp("glm-style")
    model_dir = make_glm_style_checkpoint(root, mla_dirs["glm4_moe_lite"])
    with styled_server(root, model_dir, "glm") as served:
        yield served


def test_an_agent_loop_resumes_its_chain_and_drops_emptied_reasoning(glm):
    server, client, tokenizer = glm
    messages = [SYSTEM, {"role": "user", "content": "List the files."}]
    forced = forced_reply(tokenizer, CALL, "<|observation|>")
    r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0,
                                       max_tokens=len(forced) + 2, extra_body={"forced_token_ids": forced})
    message = r.choices[0].message
    # the think and call tags are special tokens: kept in the text, so both are read
    assert message.model_extra["reasoning_content"] == "Plan it." and message.content == "Listing."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("bash", {"cmd": "ls", "n": 2})]
    chain_id = r.model_extra["chain"]["id"]
    messages += [{"role": "assistant", "content": message.content, "tool_calls": [
                     {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                     for c in message.tool_calls]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.py"}]
    forced = forced_reply(tokenizer, ANSWER, "<|user|>")
    r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0,
                                       max_tokens=len(forced) + 2, extra_body={"forced_token_ids": forced})
    assert r.choices[0].message.content == "There is a.py." and r.choices[0].finish_reason == "stop"
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Thanks."}]
    r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
    assert r.model_extra["chain"]["id"] == chain_id
    chain = chain_record(server.url, chain_id)
    observation, user = (tokenizer.convert_tokens_to_ids(t) for t in ("<|observation|>", "<|user|>"))
    for turn, stop in zip(chain["turns"][1:], (observation, user)):
        assert turn["resume_status"] == "resumed"
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
        # the reply ended on the tag that opens the next message: the turn does not write it again
        assert turn["appended_token_ids"][0] != stop
    # after the new user message the template empties both earlier think blocks: their reasoning left the KV
    reasoning = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in ("Plan it.", "Read it."))
    kv = chain["kv"]
    last_reply = len(chain["turns"][-1]["generated_token_ids"])
    assert kv["logical_tokens"] == len(prompt_log(chain)) + last_reply
    assert kv["computed_tokens"] - kv["physical_tokens"] == reasoning
    # the log is what a fresh rendering of the conversation holds, the emptied reasoning apart
    fresh = copy.deepcopy(messages)
    fresh[2]["tool_calls"][0]["function"]["arguments"] = {"cmd": "ls", "n": 2}
    fresh[2]["content"], fresh[4]["content"] = CALL.split("\nListing.")[0] + "\nListing.", ANSWER
    rendered = tokenizer.apply_chat_template(fresh, tools=[BASH], tokenize=False, add_generation_prompt=True)
    logged = tokenizer.decode(prompt_log(chain))
    assert logged.replace("Plan it.", "").replace("Read it.", "") == rendered


def test_history_from_elsewhere_is_imported_as_the_template_writes_it(glm):
    server, client, tokenizer = glm
    messages = [SYSTEM, {"role": "user", "content": "Imported: list the files."},
                {"role": "assistant", "content": "Listing.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash",
                                                                       "arguments": '{"cmd": "ls", "n": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0, max_tokens=2)
    chain = chain_record(server.url, r.model_extra["chain"]["id"])
    fresh = copy.deepcopy(messages)
    fresh[2]["tool_calls"][0]["function"]["arguments"] = {"cmd": "ls", "n": 2}
    rendered = tokenizer.apply_chat_template(fresh, tools=[BASH], tokenize=False, add_generation_prompt=True)
    assert prompt_log(chain) == \
        tokenizer.encode(rendered, add_special_tokens=False)


def test_the_anthropic_client_gets_thinking_text_and_tool_use(glm):
    server, _, tokenizer = glm
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    forced = forced_reply(tokenizer, CALL, "<|observation|>")
    tools = [{"name": "bash", "input_schema": BASH["function"]["parameters"]}]
    m = client.messages.create(model="glm", max_tokens=len(forced) + 2, tools=tools,
                               messages=[{"role": "user", "content": "Anthropic: list the files."}],
                               extra_body={"agentrt_forced_token_ids": forced})
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert (m.content[0].thinking, m.content[1].text, m.content[2].input) == ("Plan it.", "Listing.",
                                                                              {"cmd": "ls", "n": 2})
    again = client.messages.create(model="glm", max_tokens=2, tools=tools, messages=[
        {"role": "user", "content": "Anthropic: list the files."},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[2].id, "content": "a.py"}]}])
    assert again.usage.cache_read_input_tokens >= m.usage.input_tokens + m.usage.output_tokens - 1


def test_a_stateless_server_reads_the_tags_too(mla_dirs, tmp_path):
    """Without implicit chains the route is one engine request over the whole rendered conversation: the
    template gets the re-sent call's arguments as a mapping, and the reply keeps its tags."""
    model_dir = make_glm_style_checkpoint(tmp_path, mla_dirs["glm4_moe_lite"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'server.db'}", model=model_dir, model_name="glm",
                    implicit_chains=False) as server:
        client = openai_client(server.url)
        forced = forced_reply(tokenizer, CALL, "<|observation|>")
        messages = [SYSTEM, {"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": "Earlier.", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "/src"}]
        r = client.chat.completions.create(model="glm", messages=messages, tools=[BASH], temperature=0,
                                           max_tokens=len(forced) + 2, extra_body={"forced_token_ids": forced})
        assert r.model_extra.get("chain") is None
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"] == "Plan it." and message.content == "Listing."
        assert json.loads(message.tool_calls[0].function.arguments) == {"cmd": "ls", "n": 2}


def test_clear_tool_inputs_prunes_the_arg_key_pairs_of_a_cleared_call(glm):
    """Anthropic's ``clear_tool_inputs`` on GLM's calls: the cleared use's arguments are the tokens from its first
    ``<arg_key>`` to its last ``</arg_value>`` (tags of their own here), which leave the KV with its result; the
    call's name and the newest use stay."""
    server, _, tokenizer = glm
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "bash", "input_schema": BASH["function"]["parameters"]}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}
    forced = forced_reply(tokenizer, CALL, "<|observation|>")
    history: list = [{"role": "user", "content": "Clear: list the files."}]
    for step in range(2):
        raw = client.beta.messages.with_raw_response.create(
            model="glm", max_tokens=len(forced) + 2, messages=history, tools=tools,
            betas=["context-management-2025-06-27"], context_management={"edits": [edit]},
            extra_body={"agentrt_forced_token_ids": forced})
        m, chain_id = raw.parse(), raw.headers["agentrt-chain-id"]
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[-1].id,
                                                  "content": f"a{step}.py"}]}]
    m = client.beta.messages.create(model="glm", max_tokens=2, messages=history, tools=tools,
                                    betas=["context-management-2025-06-27"], context_management={"edits": [edit]})
    (applied,) = m.context_management.applied_edits
    assert applied.cleared_tool_uses == 1 and applied.cleared_input_tokens > 0
    chain = chain_record(server.url, chain_id)
    first = chain["turns"][0]
    at = len(first["appended_token_ids"])  # the first reply's tokens start here in the log
    reply = first["generated_token_ids"]
    arg_key, arg_value_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<arg_key>", "</arg_value>"))
    lo = at + reply.index(arg_key)
    hi = at + len(reply) - reply[::-1].index(arg_value_end)
    pruned = chain["pruned_intervals"]
    assert any(a <= lo and hi <= b for a, b in pruned), (lo, hi, pruned)
    name = at + reply.index(tokenizer.convert_tokens_to_ids("<tool_call>")) + 1  # the name's first token
    assert not any(a <= name < b for a, b in pruned)
    # what was cleared: the first result and exactly those argument tokens
    results = [r for r in chain["regions"] if r["kind"] == "tool_result"]
    assert [r["pruned"] for r in results] == [True, False]
    assert sum(b - a for a, b in pruned) == applied.cleared_input_tokens == \
        results[0]["end"] - results[0]["start"] + hi - lo
