"""Chat rendering onto an append-only log, and tool-call parsing (no engine)."""

from __future__ import annotations

import json

import pytest

from agentrt.chat import ChatRenderer
from agentrt.tool_syntax import ToolCallReader, by_name
from tests.server_helpers import WEATHER_TOOL

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax


@pytest.fixture(scope="module")
def renderer():
    from engine.tiny_checkpoint import IM_END, train_tokenizer

    tokenizer = train_tokenizer()
    return ChatRenderer(tokenizer, [tokenizer.convert_tokens_to_ids(IM_END)])


def test_appending_renders_exactly_the_new_suffix(renderer):
    system = {"role": "system", "content": "sys"}
    user = {"role": "user", "content": "hi"}
    first = renderer.append([], [system, user], [WEATHER_TOOL], assistant_prefix="<tool_call>")
    assert [p.kind for p in first.pieces] == ["system", "user"]
    full = renderer.render([system, user], [WEATHER_TOOL], generation_prompt=True) + "<tool_call>"
    assert renderer.decode(first.token_ids) == full and first.close_ids == []

    history = [system, user, {"role": "assistant", "content": "<tool_call>x"}]
    tools = [{"role": "tool", "content": "A", "tool_call_id": "1"}, {"role": "tool", "content": "B", "tool_call_id": "2"}]
    second = renderer.append(history, tools, [WEATHER_TOOL], last_token=renderer.encode("x")[-1])
    assert renderer.decode(second.close_ids) == "<|im_end|>\n"
    texts = [renderer.decode(p.token_ids) for p in second.pieces]
    assert texts == ["<|im_start|>user\n<tool_response>\nA\n</tool_response>",  # both results share one user turn
                     "\n<tool_response>\nB\n</tool_response><|im_end|>\n"]
    assert renderer.decode(second.prompt_ids) == "<|im_start|>assistant\n"
    expected = renderer.render(history + tools, [WEATHER_TOOL], generation_prompt=True)
    assert renderer.decode(first.token_ids[:-len(renderer.encode("<tool_call>"))] + renderer.encode("<tool_call>x")
                           + second.token_ids) == expected

    stopped = renderer.append(history, tools, [WEATHER_TOOL], last_token=next(iter(renderer.stop_token_ids)))
    assert renderer.decode(stopped.close_ids) == "\n"  # the model's own <|im_end|> is kept, not repeated


def test_tool_calls_are_parsed_and_malformed_ones_skipped():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"u": "c"}}}\n'
            '</tool_call><tool_call>{"name": "noop"}</tool_call><tool_call>not json</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "raw", "arguments": "{\\"a\\": 1}"}</tool_call>')
    calls = HERMES.reply_calls(text)
    assert [c.function.name for c in calls] == ["get_weather", "noop", "raw"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "opts": {"u": "c"}}
    assert calls[1].function.arguments == "{}" and calls[2].function.arguments == '{"a": 1}'
    assert len({c.id for c in calls}) == 3
    assert HERMES.reply_content(text).startswith("Let me check.") and "get_weather" not in HERMES.reply_content(text)
    assert HERMES.reply_calls("no calls here") == []
