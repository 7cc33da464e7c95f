"""A chat template that drops earlier replies' reasoning (Qwen3's: every think block before the last user
message, and in a tool loop the empty ones) no longer breaks a chain's next turn: the turn appends only its new
messages and the dropped think blocks leave the chain's KV as a prune (agentrt.chat, agentrt.reasoning.ThinkLog,
``ChainPruner.drop_reasoning`` in agentrt.chain_pruning).

The template here follows Qwen3's published rules for assistant messages (written for this test on the tiny
test template: the reasoning split off at ``</think>``, rendered with its block only after the last user message
and then only when non-empty or last; ``enable_thinking`` false closes an empty block in the generation prompt;
``preserve_thinking``, as Qwen3.6's template takes it, keeps every block).
Reference: the template's own rendering of the whole conversation, which the chain's token log less the dropped
spans, plus the appended tokens, must decode to exactly."""

from __future__ import annotations

import httpx
import pytest

from agentrt.chat import ChatRenderer, TemplateMismatchError, template_kwargs
from agentrt.reasoning import think_tokens
from engine.tiny_checkpoint import CHAT_TEMPLATE
from tests.live_servers import app_server, openai_client
from tests.server.test_reasoning import END, GENERATED, THOUGHT, _thinking_model
from tests.server_helpers import TOOL_CALL, WEATHER_TOOL

_ASSISTANT = """    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
"""
_DROPPING = """    {%- if message.role == 'assistant' and not message.tool_calls %}
        {%- set content = message.content or '' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if ((preserve_thinking is defined and preserve_thinking) or loop.index0 > ns.last_query) and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif (message.role == 'user') or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
"""
_LAST_QUERY = """{%- set ns = namespace(last_query=messages|length - 1, looking=true) %}
{%- for message in messages[::-1] %}
    {%- if ns.looking and message.role == 'user' %}
        {%- set ns.looking = false %}
        {%- set ns.last_query = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
"""
_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
DROPPING_TEMPLATE = (CHAT_TEMPLATE.replace(_ASSISTANT, _DROPPING).replace("{%- for message in messages %}\n", _LAST_QUERY)
                     .replace(_GENERATION_PROMPT, """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""))
assert _ASSISTANT in CHAT_TEMPLATE and _GENERATION_PROMPT in CHAT_TEMPLATE and DROPPING_TEMPLATE.count("ns.last_query") == 2
SYSTEM = {"role": "system", "content": "S"}
CALL_REPLY = f"Checking.\n{TOOL_CALL}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    out = _thinking_model(tmp_path_factory.mktemp("model"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = DROPPING_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, [tokenizer.convert_tokens_to_ids(END)])


def _generated(renderer, text: str) -> list[int]:
    return renderer.encode(text) + [renderer.tokenizer.convert_tokens_to_ids(END)]


def _without(log: list[int], spans: list[tuple[int, int]]) -> list[int]:
    drop = {i for lo, hi in spans for i in range(lo, hi)}
    return [t for i, t in enumerate(log) if i not in drop]


def _turn(renderer, history, log, dropped, new, reply, **kwargs):
    """Append ``new`` to the log, check it against the template's rendering, then add ``reply`` (generated)."""
    with template_kwargs(**kwargs):
        appended = renderer.append(history, new, [WEATHER_TOOL], log[-1] if log else None, log_ids=log)
        expected = renderer.render(history + new, [WEATHER_TOOL], generation_prompt=True)
    dropped = sorted(set(dropped) | set(appended.dropped))
    assert renderer.decode(_without(log, dropped) + appended.token_ids) == expected
    # every new message's piece is its own rendering (the pieces and the prompt tile the new part)
    assert [p.message for p in appended.pieces] == new
    return history + new + [{"role": "assistant", "content": reply}], log + appended.token_ids + _generated(
        renderer, reply), dropped, appended


def test_a_turn_after_a_thinking_reply_drops_the_block_the_template_drops(renderer, tokenizer):
    think = think_tokens(tokenizer)
    history, log, dropped, first = _turn(renderer, [], [], [], [SYSTEM, {"role": "user", "content": "Q1"}], GENERATED)
    assert first.dropped == []
    history, log, dropped, second = _turn(renderer, history, log, dropped, [{"role": "user", "content": "Q2"}],
                                          GENERATED)
    (lo, hi), = second.dropped  # the first reply's block, through the blank line after it
    assert log[lo] == think.open_id and renderer.decode(log[lo:hi]) == f"<think>\n{THOUGHT}\n</think>\n\n"
    # a tool loop keeps a non-empty block after the last user message: nothing more is dropped
    history, log, dropped, _ = _turn(renderer, history, log, dropped, [{"role": "user", "content": "Q2b"}],
                                     f"<think>\n{THOUGHT}\n</think>\n\n{CALL_REPLY}")
    tool = {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    history, log, dropped, third = _turn(renderer, history, log, dropped, [tool], GENERATED)
    assert third.dropped == []  # an append-only turn: no alignment needed
    # a user message drops both blocks of that loop; with thinking off the prompt closes an empty block ...
    history, log, dropped, fourth = _turn(renderer, history, log, dropped, [{"role": "user", "content": "Q3"}],
                                          CALL_REPLY, enable_thinking=False)
    assert len(fourth.dropped) == 4 and fourth.dropped[0] == (lo, hi)
    # ... which goes once a tool result follows (an empty block is kept only in the last message)
    history, log, dropped, fifth = _turn(renderer, history, log, dropped, [dict(tool, tool_call_id="call_2")],
                                         CALL_REPLY, enable_thinking=False)
    assert [renderer.decode(log[a:b]) for a, b in fifth.dropped if (a, b) not in fourth.dropped] == [
        "<think>\n\n</think>\n\n"]


def test_any_other_difference_is_still_a_template_mismatch(renderer):
    history, log, _, _ = _turn(renderer, [], [], [], [SYSTEM, {"role": "user", "content": "Q1"}], GENERATED)
    other = list(log)
    other[2] = renderer.encode("X")[0]  # the log no longer holds what the template renders before the block
    with pytest.raises(TemplateMismatchError):
        renderer.append(history, [{"role": "user", "content": "Q2"}], [WEATHER_TOOL], log[-1], log_ids=other)
    with pytest.raises(TemplateMismatchError):  # without the log the dropped block cannot be found
        renderer.append(history, [{"role": "user", "content": "Q2"}], [WEATHER_TOOL], log[-1])


def test_a_chain_resumes_with_the_reasoning_pruned(model_dir, tmp_path, tokenizer):
    """Through the openai package on an implicit chain: each later request resumes the chain (prefill = the new
    part + 1), the earlier replies' think blocks are pruned (a ``template`` prune event per turn, its intervals
    the blocks in the chain's token log), and what the chain holds less the pruned spans is the template's
    rendering of the conversation."""
    think = think_tokens(tokenizer)
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", model=model_dir) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        client = openai_client(server.url)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Q1"}]
        chain_id = None
        for turn in range(3):
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                                   extra_body={"forced_token_ids": _generated_ids(tokenizer)})
            chain = reply.model_extra["chain"]
            chain_id = chain_id or chain["id"]
            assert chain["id"] == chain_id and chain["resume_status"] == ("created" if turn == 0 else "resumed")
            assert reply.choices[0].message.reasoning_content == THOUGHT
            messages += [reply.choices[0].message.model_dump(include={"role", "content"}),
                         {"role": "user", "content": f"Q{turn + 2}"}]
        read = http.get(f"/v1/chains/{chain_id}?include_tokens=true").json()
        log = read["token_ids"]
        blocks = [i for i, t in enumerate(log) if t == think.open_id]
        events = [e for e in read["prune_events"] if e["source"] == "template"]
        assert len(events) == 2 and [e["intervals"][0][0] for e in events] == blocks[:2]
        for event in events:
            (lo, hi), = event["intervals"]
            assert tokenizer.decode(log[lo:hi]) == f"<think>\n{THOUGHT}\n</think>\n\n" and event["tokens_freed"] == hi - lo
        prompt = log[:len(log) - len(read["turns"][-1]["generated_token_ids"])]
        spans = [tuple(e["intervals"][0]) for e in events]
        system = {"role": "system", "content": tokenizer.decode(prompt).split("<|im_start|>system\n")[1].split(END)[0]}
        expected = tokenizer.apply_chat_template([system, *messages[:-2]], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(_without(prompt, spans)) == expected
        for turn in read["turns"][1:]:
            assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1


def _generated_ids(tokenizer) -> list[int]:
    return tokenizer.encode(GENERATED, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(END)]


def test_preserve_thinking_keeps_every_block_and_prunes_nothing(model_dir, tmp_path, tokenizer):
    """``chat_template_kwargs.preserve_thinking`` (Qwen3.6's switch) reaches the template: the conversation renders
    append-only, so later turns resume with no template prune."""
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", model=model_dir) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        client = openai_client(server.url)
        model = client.models.list().data[0].id
        messages, chain_id = [{"role": "user", "content": "P1"}], None
        for turn in range(3):
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=64, temperature=0,
                extra_body={"forced_token_ids": _generated_ids(tokenizer),
                            "chat_template_kwargs": {"preserve_thinking": True}})
            chain_id = chain_id or reply.model_extra["chain"]["id"]
            assert reply.model_extra["chain"]["id"] == chain_id
            assert reply.model_extra["chain"]["resume_status"] == ("created" if turn == 0 else "resumed")
            messages += [reply.choices[0].message.model_dump(include={"role", "content"}),
                         {"role": "user", "content": f"P{turn + 2}"}]
        read = http.get(f"/v1/chains/{chain_id}").json()
        assert read["num_turns"] == 3 and read["prune_events"] == []
