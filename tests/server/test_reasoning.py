"""Reasoning ("thinking") split off the reply on every route (agentrt.reasoning): the parser against hand-built
texts, then chat completions, Responses and Anthropic Messages end to end through the official ``openai`` and
``anthropic`` packages against a live server.

No shipped model writes ``<think>``, so the live server runs a thinking model made here: the random test
checkpoint with ``<think>`` / ``</think>`` added to its tokenizer (as Qwen3 has them: added, not special), its
embeddings grown to match, and a Qwen3-style chat template: ``enable_thinking`` false closes an empty think
block in the generation prompt (Qwen3's own behavior); true opens one (``<think>\\n``, as templates of models
that always think do), so that one server shows both a model-opened and a template-opened block; unset leaves
the generation prompt bare (the model opens the block itself). The generated text is forced token by token
(the routes' ``forced_token_ids`` test extensions): the real engine emits it, the real routes and parser split
it. References: the hand-written reasoning and answer each text was made of."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import msgspec
import pytest

from agentrt.anthropic_events import THINKING_SIGNATURE, BlockWriter
from agentrt.anthropic_types import ThinkingBlock, ToolUseBlock
from agentrt.chat import ChatRenderer, template_kwargs
from agentrt.reasoning import ReasoningParser, ThinkTokens, opens_think, split_reasoning, think_tokens
from agentrt.tool_syntax import ToolCallReader, by_name
from engine.tiny_checkpoint import CHAT_TEMPLATE, embedded_model_dir, random_model_dir
from tests.live_servers import app_server, client, model, random_model_server  # noqa: F401 (client, model: fixtures over the server below)
from tests.server_helpers import TOOL_CALL, WEATHER_TOOL

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

THOUGHT = "The user says hello.\nA short greeting back will do."
ANSWER = "Hello there!"
GENERATED = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # a model that opens its think block itself
CONTINUED = f"{THOUGHT}\n</think>\n\n{ANSWER}"  # after a generation prompt that opened it
END = "<|im_end|>"
THINK_PROMPT_TAIL = {"open": "<|im_start|>assistant\n<think>\n",  # the generation prompt, thinking on / off
                     "closed": "<|im_start|>assistant\n<think>\n\n</think>\n\n"}

_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
THINK_TEMPLATE = CHAT_TEMPLATE.replace(_GENERATION_PROMPT, """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- elif enable_thinking is defined and enable_thinking %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
""")
assert THINK_TEMPLATE != CHAT_TEMPLATE


# --- the parser -------------------------------------------------------------------------------------------------
def _fed(pieces: list[str], opened: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    parser, deltas = ReasoningParser(opened), []
    for piece in pieces:
        deltas.append(parser.feed(piece))
    deltas.append(parser.finish())
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


def _every_split(text: str):
    """The text in one piece, in two at every position, in three at every pair of positions, one char a piece."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


CASES = [  # (text, opened by the prompt, reasoning, content)
    (GENERATED, False, THOUGHT, ANSWER),
    ("  \n<think>R</think>A", False, "R", "A"),  # whitespace before the block
    ("<think>\n\n</think>\n\nA", False, "", "A"),  # an empty block
    ("<think>\nR1\n\nR2 \n</think>\n\n  A\n", False, "R1\n\nR2", "A\n"),  # the content's end as generated
    (ANSWER, False, "", ANSWER),  # no think block
    ("\n\nA <think>x</think>", False, "", "\n\nA <think>x</think>"),  # a tag after the start is text
    ("A</think>B", False, "", "A</think>B"),  # a close tag without an open block is text
    ("<thin", False, "", "<thin"),  # a partial tag at the end is text
    ("<think>\nR and more", False, "R and more", ""),  # unterminated: max_tokens cut the block
    ("<think>\nR </thi", False, "R </thi", ""),  # ... in the middle of its closing tag
    (CONTINUED, True, THOUGHT, ANSWER),  # the template opened the block
    ("<think>\nR</think>A", True, "R", "A"),  # ... and the model wrote <think> anyway
    ("R unterminated\n", True, "R unterminated", ""),
    ("</think>A", True, "", "A"),
    ("", True, "", ""),
    ("", False, "", ""),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_the_parser_splits_the_same_whatever_the_cuts(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    for pieces in _every_split(text):
        assert _fed(pieces, opened)[:2] == (reasoning, content), pieces


def test_text_is_released_as_soon_as_it_is_decided():
    parser = ReasoningParser()
    assert parser.feed("<thi") == ("", "")  # may be the tag
    assert parser.feed("nk>\nStep one") == ("Step one", "")
    assert parser.feed(" and two.\n") == (" and two.", "")  # the trailing newline may end the block
    assert parser.feed("</th") == ("", "")
    assert parser.feed("ink>\n\n") == ("", "")  # the separator is dropped
    assert parser.feed("Hi") == ("", "Hi")
    assert parser.feed(" you <think>") == ("", " you <think>")
    assert parser.finish() == ("", "")
    assert parser.found and parser.closed
    plain = ReasoningParser()
    assert plain.feed("Hello") == ("", "Hello") and not plain.found


def test_infers_the_block_from_the_text_when_the_prompt_is_not_at_hand():
    assert split_reasoning(GENERATED) == (THOUGHT, ANSWER)
    assert split_reasoning(CONTINUED) == (THOUGHT, ANSWER)  # a close before any open: the template opened it
    assert split_reasoning(ANSWER) == ("", ANSWER)
    # the text a route returns for a chain's stored message (what clients echo back), and the calls in it
    said = f"<think>\nMaybe {TOOL_CALL} here?\n</think>\n\nLet me check.\n{TOOL_CALL}"
    assert HERMES.reply_content(said) == "Let me check."
    assert len(HERMES.reply_calls(said)) == 1  # the call written inside the reasoning is not a call
    assert HERMES.reply_content(CONTINUED) == ANSWER and HERMES.reply_calls(CONTINUED) == []
    assert HERMES.reply_content(f"Plain {TOOL_CALL}") == "Plain"


def test_opens_think_reads_the_generation_prompt():
    think, stops = ThinkTokens(open_id=7, close_id=8), {2}
    assert opens_think([1, 2, 5, 7, 9], think, stops)  # <think> in the generation prompt
    assert not opens_think([1, 2, 5, 7, 9, 8, 4], think, stops)  # opened and closed: thinking off
    assert not opens_think([1, 7, 2, 5], think, stops)  # an open tag before the last message's end
    assert not opens_think([1, 2, 5], think, stops)


# --- the thinking model ------------------------------------------------------------------------------------------
def _thinking_model(root: Path) -> Path:
    """The random test checkpoint with <think> and </think> added (ids 512, 513), its vocabulary grown to 576
    rows, and THINK_TEMPLATE."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    src, out = random_model_dir(), root / "qwen3-think"
    shutil.copytree(src, out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(src)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    vocab = config["vocab_size"] + 64
    assert len(tokenizer) <= vocab
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weight = tensors[name]
        extra = torch.randn(vocab - weight.shape[0], weight.shape[1], generator=generator).to(weight.dtype) * 0.02
        tensors[name] = torch.cat([weight, extra]).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _thinking_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer):
    def encode(text: str, end: bool = True) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.convert_tokens_to_ids(END)] if end
                                                                   else [])
    return encode


def test_the_thinking_model_and_no_other_has_think_tokens(tokenizer, tokens):
    from transformers import AutoTokenizer

    think = think_tokens(tokenizer)
    assert think is not None and tokens("<think></think>", end=False) == [think.open_id, think.close_id]
    assert think_tokens(AutoTokenizer.from_pretrained(embedded_model_dir())) is None
    assert think_tokens(AutoTokenizer.from_pretrained(random_model_dir())) is None


def test_a_chain_turn_appends_after_a_reply_whatever_enable_thinking_is(tokenizer, tokens):
    """The template's generation prompt holds a think block the assistant message's rendering does not: the
    previous reply is still closed by what follows its content (``<|im_end|>\\n``, less the stop token)."""
    renderer = ChatRenderer(tokenizer, [tokenizer.convert_tokens_to_ids(END)])
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": CONTINUED}]
    for thinking in (None, True, False):
        with template_kwargs(enable_thinking=thinking):
            appended = renderer.append(history, [{"role": "user", "content": "More"}], None,
                                       last_token=tokens("", end=True)[0])
            tail = renderer.decode(appended.prompt_ids)
        assert renderer.decode(appended.close_ids) == "\n"
        assert tail == {None: "<|im_start|>assistant\n", True: THINK_PROMPT_TAIL["open"],
                        False: THINK_PROMPT_TAIL["closed"]}[thinking]
        assert renderer.thinking(appended.token_ids) is (thinking is True)


# --- the live server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with app_server(f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'server.db'}", model=model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _chain(http, chain_id: str) -> dict:
    r = http.get(f"/v1/chains/{chain_id}?include_tokens=true")
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_tail(http, tokenizer, chain_id: str) -> str:
    """The last turn's generation prompt, from the chain's token log."""
    chain = _chain(http, chain_id)
    turn = chain["turns"][-1]
    prompt = chain["token_ids"][:len(chain["token_ids"]) - len(turn["generated_token_ids"])]
    text = tokenizer.decode(prompt)
    return text[text.rindex("<|im_start|>assistant"):]


# --- chat completions ---------------------------------------------------------------------------------------------
def _chat(client, model, user: str, forced: list[int], **kw):
    extra = {"forced_token_ids": forced, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": user}],
                                          max_tokens=kw.pop("max_tokens", len(forced)), temperature=0,
                                          extra_body=extra, **kw)


def _streamed(stream) -> tuple[str, str, list[tuple[str, str]], list]:
    """(reasoning, content, the (field, text) deltas in order, the chunks)."""
    chunks = list(stream)
    deltas = []
    for chunk in chunks:
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                deltas.append(("reasoning", choice.delta.reasoning_content))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
    return ("".join(t for f, t in deltas if f == "reasoning"), "".join(t for f, t in deltas if f == "content"),
            deltas, chunks)


@pytest.mark.parametrize("stateless", [False, True], ids=["chain", "stateless"])
def test_chat_completion_returns_the_reasoning_apart(client, model, tokens, stateless):
    kw = {"logprobs": True} if stateless else {}  # logprobs keep a request off the implicit chains
    reply = _chat(client, model, f"Hi ({stateless})", tokens(GENERATED), **kw)
    message = reply.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert ("chain" in reply.model_extra) is not stateless
    if stateless:  # one log-probability per generated token, the reasoning's included
        assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens == len(tokens(GENERATED))
    reasoning, content, deltas, _ = _streamed(_chat(client, model, f"Hi again ({stateless})", tokens(GENERATED),
                                                    stream=True, **kw))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert [f for f, _ in deltas] == sorted((f for f, _ in deltas), reverse=True)  # the reasoning, then content
    assert len([f for f, _ in deltas if f == "reasoning"]) > 1  # streamed as generated, not at the end


def test_chat_completion_effort_and_template_kwargs_switch_thinking(client, model, tokens, http, tokenizer):
    # off: the template closes an empty block in the prompt, the model answers at once
    off = _chat(client, model, "Quick one", tokens(ANSWER), reasoning_effort="none")
    assert off.choices[0].message.content == ANSWER
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert _prompt_tail(http, tokenizer, off.model_extra["chain"]["id"]) == THINK_PROMPT_TAIL["closed"]
    # on: this template opens the block in the prompt, the model's text starts inside it
    for kw in ({"reasoning_effort": "high"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
               {"reasoning_effort": "none", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}):
        on = _chat(client, model, f"Think first {kw}", tokens(CONTINUED), **kw)
        assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == (THOUGHT, ANSWER)
        assert _prompt_tail(http, tokenizer, on.model_extra["chain"]["id"]) == THINK_PROMPT_TAIL["open"]
        reasoning, content, _, _ = _streamed(_chat(client, model, f"Think again {kw}", tokens(CONTINUED),
                                                   stream=True, **kw))
        assert (reasoning, content) == (THOUGHT, ANSWER)
    # stateless too (the prompt rendered here, not by a chain turn)
    on = _chat(client, model, "Stateless thinking", tokens(CONTINUED), reasoning_effort="low", logprobs=True)
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == (THOUGHT, ANSWER)
    r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                                "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                                "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tools"


def test_chat_completion_cut_while_thinking_is_all_reasoning(client, model, tokens, tokenizer):
    forced = tokens(GENERATED)[:6]  # max_tokens ends the text inside the think block
    cut = tokenizer.decode(forced)
    assert cut.startswith("<think>\n") and THOUGHT.startswith(cut.removeprefix("<think>\n"))
    for kw in ({}, {"logprobs": True}):
        reply = _chat(client, model, f"Cut short {kw}", forced, **kw)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "length" and message.content is None
        assert message.reasoning_content == cut.removeprefix("<think>\n").strip()
        reasoning, content, _, _ = _streamed(_chat(client, model, f"Cut again {kw}", forced, stream=True, **kw))
        assert (reasoning, content) == (message.reasoning_content, "")


def test_chat_tool_calls_are_read_after_the_reasoning(client, model, tokens):
    said = f"<think>\nMaybe {TOOL_CALL} now?\n</think>\n\nLet me check.\n{TOOL_CALL}"
    for stream in (False, True):
        reply = _chat(client, model, f"Weather in Paris ({stream})?", tokens(said), tools=[WEATHER_TOOL],
                      stream=stream)
        if stream:
            chunks = list(reply)
            calls = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
            reasoning = "".join(getattr(choice.delta, "reasoning_content", None) or ""
                                for ch in chunks for choice in ch.choices)
            content = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
            finish = [choice.finish_reason for ch in chunks for choice in ch.choices if choice.finish_reason]
        else:
            message = reply.choices[0].message
            calls, reasoning, content = message.tool_calls, message.reasoning_content, message.content
            finish = [reply.choices[0].finish_reason]
        assert reasoning == f"Maybe {TOOL_CALL} now?" and content == "Let me check."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
        assert finish == ["tool_calls"]


def test_an_echoed_reply_resumes_its_chain(client, model, tokens, http, server):
    """The client sends back the message as returned (content without the reasoning, maybe the reasoning in
    ``reasoning_content``): it matches the chain's turn as generated, so the chain is resumed, not forked; with
    ``chain_id`` it is no 409. Turns with thinking on, off and left to the template follow each other."""
    history = [{"role": "user", "content": "Resume me"}]
    first = client.chat.completions.create(model=model, messages=history, max_tokens=64, temperature=0,
                                           extra_body={"forced_token_ids": tokens(GENERATED)})
    chain_id = first.model_extra["chain"]["id"]
    for i, (kw, said) in enumerate([({"reasoning_effort": "none"}, ANSWER), ({"reasoning_effort": "high"}, CONTINUED),
                                    ({}, GENERATED)]):
        message = first.choices[0].message.model_dump(include={"role", "content", "reasoning_content"})
        history += [message, {"role": "user", "content": f"And {i}?"}]
        first = client.chat.completions.create(model=model, messages=history, max_tokens=64, temperature=0,
                                               extra_body={"forced_token_ids": tokens(said)}, **kw)
        assert first.model_extra["chain"]["id"] == chain_id
        assert first.model_extra["chain"]["resume_status"] == "resumed"
        assert first.choices[0].message.content == ANSWER
    assert _chain(http, chain_id)["num_turns"] == 4
    # the chain_id extension: the same echo is the chain's history
    made = http.post("/v1/chains", json={}).json()["id"]
    history = [{"role": "user", "content": "Chained"}]
    for i, said in enumerate((GENERATED, GENERATED)):
        reply = client.chat.completions.create(model=model, messages=history, max_tokens=64, temperature=0,
                                               extra_body={"forced_token_ids": tokens(said), "chain_id": made})
        assert reply.choices[0].message.reasoning_content == THOUGHT
        assert reply.model_extra["chain"]["turn"] == i
        history += [reply.choices[0].message.model_dump(include={"role", "content", "reasoning_content"}),
                    {"role": "user", "content": "Next"}]


def test_a_model_that_does_not_think_is_unchanged(tmp_path_factory):
    """The random model's tokenizer has no think tokens: the same text is content, as generated, and no
    reasoning field appears; a reasoning_effort level has no effect, a value that is no level is refused."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_model_dir())
    forced = tok.encode(GENERATED, add_special_tokens=False)
    with random_model_server(tmp_path_factory.mktemp("plain")) as s, httpx.Client(base_url=s.url, timeout=120) as h:
        name = h.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": len(forced),
                "forced_token_ids": forced, "temperature": 0}
        message = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message == {"content": tok.decode(forced).strip(), "role": "assistant", "tool_calls": None}
        assert "<think>" in message["content"]
        same = h.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"})  # no effect here
        assert same.status_code == 200 and same.json()["choices"][0]["message"] == message
        r = h.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


# --- the Responses API --------------------------------------------------------------------------------------------
def _respond(client, model, input, forced, **kw):
    extra = {"forced_token_ids": forced, **kw.pop("extra_body", {})}
    return client.responses.create(model=model, input=input, temperature=0, extra_body=extra,
                                   max_output_tokens=kw.pop("max_output_tokens", len(forced)), **kw)


def test_responses_put_a_reasoning_item_before_the_message(client, model, tokens, http, tokenizer, server):
    response = _respond(client, model, "Hello", tokens(GENERATED))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert reasoning.id.startswith("rs_")
    assert message.type == "message" and message.content[0].text == ANSWER and response.output_text == ANSWER
    think_block = tokens(GENERATED.split("</think>")[0] + "</think>", end=False)
    assert response.usage.output_tokens_details.reasoning_tokens == len(think_block)
    assert response.usage.output_tokens == len(tokens(GENERATED))
    # continued with the output echoed (the reasoning item included): one more turn of the chain
    echoed = [item.model_dump(exclude_unset=True) for item in response.output]
    follow = _respond(client, model, [*echoed, {"role": "user", "content": "And?"}], tokens(CONTINUED),
                      previous_response_id=response.id, reasoning={"effort": "medium"})
    assert [o.type for o in follow.output] == ["reasoning", "message"]
    assert follow.output[0].content[0].text == THOUGHT and follow.output_text == ANSWER
    opened_block = tokens(CONTINUED.split("</think>")[0] + "</think>", end=False)
    assert follow.usage.output_tokens_details.reasoning_tokens == len(opened_block)
    from agentrt.responses import responses_service

    chain_id = responses_service(server.app.state).records[follow.id].chain_id
    assert chain_id == responses_service(server.app.state).records[response.id].chain_id
    assert _prompt_tail(http, tokenizer, chain_id) == THINK_PROMPT_TAIL["open"]
    off = _respond(client, model, "Quick", tokens(ANSWER), reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == ANSWER
    assert off.usage.output_tokens_details.reasoning_tokens == 0
    chain_id = responses_service(server.app.state).records[off.id].chain_id
    assert _prompt_tail(http, tokenizer, chain_id) == THINK_PROMPT_TAIL["closed"]
    cut = _respond(client, model, "Cut", tokens(GENERATED)[:6])
    assert cut.status == "incomplete" and [o.type for o in cut.output] == ["reasoning"]
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 6
    r = http.post("/v1/responses", json={"model": model, "input": "x", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


def test_responses_stream_reasoning_text_events(client, model, tokens):
    events = list(_respond(client, model, "Stream it", tokens(GENERATED), stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_text = kinds.index("response.output_text.delta")
    reasoning_kinds = [k for k in kinds[:first_text] if k not in ("response.created", "response.in_progress")]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert reasoning_kinds == ["response.output_item.added", "response.content_part.added",
                               *["response.reasoning_text.delta"] * len(deltas), "response.reasoning_text.done",
                               "response.content_part.done", "response.output_item.done",
                               "response.output_item.added", "response.content_part.added"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == THOUGHT
    added = events[kinds.index("response.output_item.added")]
    assert added.output_index == 0 and added.item.type == "reasoning"
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == THOUGHT and done.output_index == 0
    assert all(e.output_index == 1 for e in events if e.type == "response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    final = events[-1].response
    assert events[-1].type == "response.completed"
    item_done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in item_done] == [o.model_dump() for o in final.output]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    # template-opened, and cut while thinking
    opened = list(_respond(client, model, "Stream opened", tokens(CONTINUED), stream=True,
                           reasoning={"effort": "high"}))
    assert [o.type for o in opened[-1].response.output] == ["reasoning", "message"]
    assert opened[-1].response.output[0].content[0].text == THOUGHT
    cut = list(_respond(client, model, "Stream cut", tokens(GENERATED)[:6], stream=True))
    assert cut[-1].type == "response.incomplete" and [o.type for o in cut[-1].response.output] == ["reasoning"]
    assert not any(e.type.startswith("response.output_text") for e in cut)


# --- Anthropic Messages -------------------------------------------------------------------------------------------
def _claude(claude, model, messages, forced, stream=False, **kw):
    body = dict(model=model, max_tokens=kw.pop("max_tokens", len(forced)), messages=messages,
                extra_body={"agentrt_forced_token_ids": forced, "temperature": 0}, **kw)
    if stream:
        with claude.messages.stream(**body) as s:
            events = list(s)
            return s.get_final_message(), events, s.response.headers
    raw = claude.messages.with_raw_response.create(**body)
    return raw.parse(), None, raw.headers


def test_anthropic_thinking_block_before_the_text(claude, model, tokens):
    for stream in (False, True):
        message, events, _ = _claude(claude, model, [{"role": "user", "content": f"Hey ({stream})"}],
                                     tokens(GENERATED), stream=stream)
        thinking, text = message.content
        assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", THOUGHT, THINKING_SIGNATURE)
        assert (text.type, text.text) == ("text", ANSWER)
        assert message.stop_reason == "end_turn"
        if stream:
            raw = [e for e in events if e.type in ("content_block_start", "content_block_delta",
                                                   "content_block_stop")]
            kinds = [(e.type, e.index, getattr(getattr(e, "delta", None), "type", None)) for e in raw]
            thinking_deltas = [k for k in kinds if k[2] == "thinking_delta"]
            assert len(thinking_deltas) > 1
            assert kinds[0] == ("content_block_start", 0, None) and raw[0].content_block.type == "thinking"
            signed = [("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None)]
            assert kinds[1:len(thinking_deltas) + 3] == [*thinking_deltas, *signed]
            assert kinds[len(thinking_deltas) + 3] == ("content_block_start", 1, None)
            assert kinds[-1] == ("content_block_stop", 1, None)


def test_anthropic_thinking_switch_and_the_conversation_resumes(claude, model, tokens, http, tokenizer):
    history = [{"role": "user", "content": "Think with me"}]
    meta = {"user_id": "thinker"}
    first, _, headers = _claude(claude, model, history, tokens(CONTINUED), metadata=meta,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    chain_id = headers["agentrt-chain-id"]
    assert [b.type for b in first.content] == ["thinking", "text"] and first.content[0].thinking == THOUGHT
    assert _prompt_tail(http, tokenizer, chain_id) == THINK_PROMPT_TAIL["open"]
    # the client sends the thinking block back, as Anthropic asks: skipped, the chain resumed
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": "Now quickly"}]
    second, _, headers = _claude(claude, model, history, tokens(ANSWER), metadata=meta,
                                 thinking={"type": "disabled"}, stream=True)
    assert headers["agentrt-chain-id"] == chain_id and headers["agentrt-chain-resolution"] == "resumed"
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == ANSWER
    assert _prompt_tail(http, tokenizer, chain_id) == THINK_PROMPT_TAIL["closed"]
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                {"role": "user", "content": "Think, but keep it to yourself"},
                {"role": "assistant", "content": "<think>\nWell,"}]  # a prefill inside the think block
    third, _, headers = _claude(claude, model, history, tokens(f" then.\n</think>\n\n{ANSWER}"), metadata=meta,
                                thinking={"type": "adaptive", "display": "omitted"})
    assert headers["agentrt-chain-resolution"] == "resumed"
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in third.content] == [
        ("thinking", "", None), ("text", None, ANSWER)]
    assert third.content[0].signature == THINKING_SIGNATURE
    count = claude.messages.count_tokens(model=model, messages=history[:-1], thinking={"type": "disabled"})
    plain = claude.messages.count_tokens(model=model, messages=history[:-1])
    assert count.input_tokens - plain.input_tokens == len(tokens("<think>\n\n</think>\n\n", end=False))
    # a thinking block is an assistant's: in a user message it is refused
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "thinking", "thinking": "x", "signature": THINKING_SIGNATURE}]}])


def test_anthropic_tool_use_after_thinking(claude, model, tokens):
    said = f"<think>\nI need the weather.\n</think>\n\n{TOOL_CALL}"
    tool = {"name": "get_weather", "description": "Current weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    for stream in (False, True):
        message, _, _ = _claude(claude, model, [{"role": "user", "content": f"Weather ({stream})?"}], tokens(said),
                                tools=[tool], stream=stream)
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        assert message.content[0].thinking == "I need the weather."
        assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"


def _without_ids(blocks) -> list[dict]:
    return [{k: v for k, v in msgspec.to_builtins(b).items() if k != "id"} for b in blocks]


def test_block_writer_gives_the_same_blocks_for_any_cut():
    text = f"<think>\nR one\n</think>\n\nSay {TOOL_CALL} done"
    whole = BlockWriter(HERMES, thinking=False).whole(text)
    assert [b.__struct_config__.tag for b in whole] == ["thinking", "text", "tool_use", "text"]
    assert isinstance(whole[0], ThinkingBlock) and whole[0].thinking == "R one"
    assert isinstance(whole[2], ToolUseBlock)
    for pieces in _every_split(text):
        writer = BlockWriter(HERMES, thinking=False)
        for piece in pieces:
            writer.feed(piece)
        writer.finish()
        assert _without_ids(writer.blocks) == _without_ids(whole), pieces
    assert BlockWriter(HERMES, thinking=None).whole(text)[0].__struct_config__.tag == "text"  # no thinking model


def test_anthropic_clear_thinking_prunes_the_blocks_of_earlier_turns(claude, model, tokens, http, tokenizer):
    """``clear_thinking_20251015`` with ``keep: 1``: at each request the think blocks of every assistant turn but the
    last that has one leave the chain's KV (prune events over exactly those blocks, found here in the chain's token
    log), the report counts them as the re-sent history holds them, and the conversation still resumes; ``keep:
    "all"`` prunes nothing."""
    think = think_tokens(tokenizer)
    edit = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    history, meta, reports, chain_id = [{"role": "user", "content": "Step 1"}], {"user_id": "clearer"}, [], None
    for i in range(3):
        raw = claude.beta.messages.with_raw_response.create(
            model=model, max_tokens=len(tokens(GENERATED)), messages=history, metadata=meta,
            betas=["context-management-2025-06-27"], context_management=edit,
            extra_body={"agentrt_forced_token_ids": tokens(GENERATED), "temperature": 0})
        message, headers = raw.parse(), raw.headers
        chain_id = chain_id or headers["agentrt-chain-id"]
        assert headers["agentrt-chain-id"] == chain_id
        assert headers["agentrt-chain-resolution"] == ("created" if i == 0 else "resumed")
        reports.append([(e.type, e.cleared_thinking_turns, e.cleared_input_tokens)
                        for e in message.context_management.applied_edits])
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                    {"role": "user", "content": f"Step {i + 2}"}]
    log = _chain(http, chain_id)["token_ids"]
    opens = [i for i, t in enumerate(log) if t == think.open_id]
    block = len(tokens(GENERATED.split("</think>")[0] + "</think>\n\n", end=False))
    assert [tokenizer.decode(log[o:o + block]) for o in opens] == [GENERATED.split(ANSWER)[0]] * 3
    events = _chain(http, chain_id)["prune_events"]  # the third request found two thinking turns: cleared one
    assert [e["intervals"] for e in events] == [[[opens[0], opens[0] + block]]]
    assert reports == [[("clear_thinking_20251015", 0, 0)], [("clear_thinking_20251015", 0, 0)],
                       [("clear_thinking_20251015", 1, block)]]
    later = claude.beta.messages.create(  # three thinking turns, the last kept: two cleared (turn 0's already)
        model=model, max_tokens=2, messages=history, metadata=meta, betas=["context-management-2025-06-27"],
        context_management=edit)
    assert [(e.cleared_thinking_turns, e.cleared_input_tokens) for e in later.context_management.applied_edits] \
        == [(2, 2 * block)]
    assert [e["intervals"] for e in _chain(http, chain_id)["prune_events"]][1:] == [[[opens[1], opens[1] + block]]]
    kept = claude.beta.messages.create(
        model=model, max_tokens=2, messages=history, metadata=meta, betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert [(e.cleared_thinking_turns, e.cleared_input_tokens) for e in kept.context_management.applied_edits] \
        == [(0, 0)]
    assert len(_chain(http, chain_id)["prune_events"]) == 2  # nothing more; what was cleared stays cleared
