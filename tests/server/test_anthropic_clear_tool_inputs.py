"""``clear_tool_inputs`` of Anthropic's ``clear_tool_uses_20250919`` context edit, through the official ``anthropic``
package against a real uvicorn (tests/tenant_servers.py's fixtures with tests/server/test_anthropic_messages.py's
clients: auth on, the embedded model).

A conversation of forced tool calls (``agentrt_forced_token_ids``: the model emits exactly the markup) of three
tools; the edit runs on every request, as a client sends it. References, independent of the server's own
reading of the log: each tool_use's arguments located in its assistant turn's tokens (read back over the chain
API) as the fewest tokens whose text holds the arguments' JSON, each tool result's region, and from them the
exact intervals the prune must drop, the region flags and the reported counts; then the next request must still
resume the chain (prefill = the new part + 1)."""

from __future__ import annotations

import json

import anthropic
import pytest
from transformers import AutoTokenizer

from agentrt.tool_syntax import ToolCallReader, by_name
from engine.tiny_checkpoint import embedded_model_dir
from tests.server.test_anthropic_messages import (END, GREEDY, SEARCH, WEATHER, _chain, _returned,  # noqa: F401
                                                  alice, model)
from tests.tenant_servers import db_url, http, keys, server, tokens  # noqa: F401 (fixtures)

HERMES = ToolCallReader(by_name("hermes"))  # the embedded model's tool-call syntax

LOOKUP = {"name": "lookup", "description": "Look a record up",
          "input_schema": {"type": "object", "properties": {"id": {"type": "string"}}}}
TOOLS = [WEATHER, SEARCH, LOOKUP]
BETA = ["context-management-2025-06-27"]
# the calls u0..u4 made by the first five replies, in order
CALLS = [("get_weather", {"city": "Paris"}), ("search", {"query": "museums open late", "limit": 3}),
         ("lookup", {"id": "louvre-opening-hours-2025"}), ("get_weather", {"city": "Oslo"}),
         ("get_weather", {"city": "Rome"})]


@pytest.fixture(scope="module")
def decode():
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _markup(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _send(client, model, history, edit, forced):
    """One request with the edit, its reply forced: (message, chain id, resolution)."""
    raw = client.beta.messages.with_raw_response.create(
        model=model, max_tokens=len(forced), messages=history, tools=TOOLS, betas=BETA,
        context_management={"edits": [edit]}, metadata={"user_id": history[0]["content"]},
        extra_body={**GREEDY, "agentrt_forced_token_ids": forced})
    return raw.parse(), raw.headers["agentrt-chain-id"], raw.headers["agentrt-chain-resolution"]


def _tool_rounds(client, model, tokens, edit, ask: str) -> tuple[list, str]:
    """Five replies to ``ask`` (also the session key), each a forced call of CALLS, each answered by a tool
    result: the history ends with u4's result (not sent yet), and no request so far was over the trigger (4 tool
    uses)."""
    history: list = [{"role": "user", "content": ask}]
    cid = None
    for i, (name, args) in enumerate(CALLS):
        message, chain, how = _send(client, model, history, edit, tokens(_markup(name, args) + END))
        assert how == ("created" if i == 0 else "resumed") and chain == (cid or chain)
        cid = chain
        assert message.context_management.applied_edits == []
        (use,) = message.content
        assert (use.type, use.name, use.input) == ("tool_use", name, args)
        history += [_returned(message), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": f'{{"result": {i}, "detail": "{"y" * 30}"}}'}]}]
    return history, cid


def _input_span(decode, ids: list[int], region: dict, args, ensure_ascii: bool = True) -> tuple[int, int]:
    """The fewest tokens of the assistant region whose text holds the arguments' JSON, in the log's positions."""
    text = json.dumps(args, ensure_ascii=ensure_ascii)
    part = ids[region["start"]:region["end"]]
    assert decode(part).count(text) == 1
    lo = max(i for i in range(len(part)) if text in decode(part[i:]))
    hi = min(j for j in range(lo + 1, len(part) + 1) if text in decode(part[lo:j]))
    return region["start"] + lo, region["start"] + hi


def _merge(spans):
    out: list = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _layout(chain: dict, decode) -> tuple[list, list, list]:
    """The five tool uses' result regions, the spans of their inputs, and the assistant regions by turn."""
    results = [r for r in chain["regions"] if r["kind"] == "tool_result"]
    assistant = [r for r in chain["regions"] if r["kind"] == "assistant"]
    assert [r["tool_name"] for r in results] == [name for name, _ in CALLS]
    inputs = [_input_span(decode, chain["token_ids"], assistant[k], args) for k, (_, args) in enumerate(CALLS)]
    assert all(assistant[k]["start"] <= lo < hi <= assistant[k]["end"] for k, (lo, hi) in enumerate(inputs))
    return results, inputs, assistant


def _check_kv(chain: dict, assistant: list, inputs: list, cleared_inputs: set[int]) -> None:
    """Each assistant turn keeps all its tokens but the inputs cleared from it."""
    for k, region in enumerate(assistant):
        size = region["end"] - region["start"]
        lost = inputs[k][1] - inputs[k][0] if k in cleared_inputs else 0
        assert (region["pruned"], region["kept_tokens"]) == (False, size - lost), k
    kv = chain["kv"]  # the engine holds the chain's computed KV less every pruned interval's tokens
    assert kv["resident"] and kv["physical_tokens"] == kv["computed_tokens"] - sum(
        hi - lo for lo, hi in chain["pruned_intervals"])


def _resumes(client, http, keys, model, history, edit, cid, reply):
    """The next request: the chain is resumed, only the new part prefilled, nothing more pruned."""
    before = len(_chain(http, keys["alice"], cid)["prune_events"])
    message, chain_id, how = _send(client, model, history, edit, reply)
    chain = _chain(http, keys["alice"], cid)
    turn = chain["turns"][-1]
    assert (chain_id, how) == (cid, "resumed") and turn["resume_status"] == "resumed"
    assert message.usage.cache_read_input_tokens > 0
    assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1 == message.usage.input_tokens
    assert len(chain["prune_events"]) == before
    return message


@pytest.fixture(scope="module")
def reply(tokens):
    """A forced text reply."""
    return tokens("Noted." + END)


def test_clear_tool_inputs_prunes_the_cleared_uses_inputs_too(alice, http, keys, model, tokens, decode, reply):
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
            "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["search"], "clear_tool_inputs": True}
    history, cid = _tool_rounds(alice, model, tokens, edit, "Plan a museum day.")
    # u4's result makes five uses (> 4): all but the 2 newest non-excluded uses (u4, sent now, and u3) are
    # cleared, search's (u1) never: u0 and u2 lose their results and their inputs
    message, chain_id, how = _send(alice, model, history, edit, reply)
    assert (chain_id, how) == (cid, "resumed")
    chain = _chain(http, keys["alice"], cid)
    results, inputs, assistant = _layout(chain, decode)
    assert [r["pruned"] for r in results] == [True, False, True, False, False]
    (event,) = chain["prune_events"]
    expected = _merge([(results[k]["start"], results[k]["end"]) for k in (0, 2)] + [inputs[0], inputs[2]])
    assert event["intervals"] == expected and chain["pruned_intervals"] == expected
    assert event["tokens_freed"] == sum(hi - lo for lo, hi in expected)
    assert event["regions"] == sorted([results[0]["index"], results[2]["index"], assistant[0]["index"],
                                       assistant[2]["index"]])
    for k in (1, 3, 4):  # search's input (excluded), the kept use's and the newest one's stay in the KV
        assert not any(lo < inputs[k][1] and inputs[k][0] < hi for lo, hi in expected), k
    _check_kv(chain, assistant, inputs, {0, 2})
    result_tokens = sum(results[k]["end"] - results[k]["start"] for k in (0, 2))
    input_tokens = sum(inputs[k][1] - inputs[k][0] for k in (0, 2))
    assert input_tokens > 0
    (applied,) = message.context_management.applied_edits
    assert (applied.type, applied.cleared_tool_uses, applied.cleared_input_tokens) == \
        ("clear_tool_uses_20250919", 2, result_tokens + input_tokens)
    turn = chain["turns"][-1]  # this request's own turn resumed the pruned chain
    assert turn["resume_status"] == "resumed"
    assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
    # the next request re-sends every input and result as they were: it resumes, and reports the same edit
    history += [_returned(message), {"role": "user", "content": "Summary?"}]
    after = _resumes(alice, http, keys, model, history, edit, cid, reply)
    (applied,) = after.context_management.applied_edits
    assert (applied.cleared_tool_uses, applied.cleared_input_tokens) == (2, result_tokens + input_tokens)


def test_clear_tool_inputs_names_tools_and_catches_up_on_earlier_cleared_uses(alice, http, keys, model, tokens,
                                                                            decode, reply):
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
            "keep": {"type": "tool_uses", "value": 2}}
    history, cid = _tool_rounds(alice, model, tokens, edit, "Plan a museum week.")
    # without clear_tool_inputs: u0..u2 lose their results only
    message, _, _ = _send(alice, model, history, edit, reply)
    chain = _chain(http, keys["alice"], cid)
    results, inputs, assistant = _layout(chain, decode)
    assert [r["pruned"] for r in results] == [True, True, True, False, False]
    result_tokens = sum(r["end"] - r["start"] for r in results[:3])
    assert chain["pruned_intervals"] == _merge([(r["start"], r["end"]) for r in results[:3]])
    _check_kv(chain, assistant, inputs, set())
    assert message.context_management.applied_edits[0].cleared_input_tokens == result_tokens
    # now only get_weather's inputs: the next request clears u0's input, whose result an earlier one cleared
    # (as a stateless server would clear it on the re-sent history); search's and lookup's inputs stay
    named = {**edit, "clear_tool_inputs": ["get_weather"]}
    history += [_returned(message), {"role": "user", "content": "Any more?"}]
    message, chain_id, how = _send(alice, model, history, named, reply)
    assert (chain_id, how) == (cid, "resumed")
    chain = _chain(http, keys["alice"], cid)
    _, again, assistant = _layout(chain, decode)
    assert again == inputs
    first, second = chain["prune_events"]
    assert second["intervals"] == [list(inputs[0])] and second["regions"] == [assistant[0]["index"]]
    assert second["tokens_freed"] == inputs[0][1] - inputs[0][0]
    assert chain["pruned_intervals"] == first["intervals"] + [list(inputs[0])]
    _check_kv(chain, assistant, inputs, {0})
    (applied,) = message.context_management.applied_edits
    assert (applied.cleared_tool_uses, applied.cleared_input_tokens) == \
        (3, result_tokens + inputs[0][1] - inputs[0][0])
    history += [_returned(message), {"role": "user", "content": "Summary?"}]
    after = _resumes(alice, http, keys, model, history, named, cid, reply)
    assert after.context_management.applied_edits[0].cleared_input_tokens == applied.cleared_input_tokens


@pytest.mark.parametrize("value", ["yes", 1, None, [1], [""], ["x" * 257], {"tools": ["search"]}])
def test_bad_clear_tool_inputs_is_a_400_naming_it(alice, model, value):
    edit = {"type": "clear_tool_uses_20250919", "clear_tool_inputs": value}
    if value is None:  # null is the default (no inputs cleared): accepted
        message = alice.beta.messages.create(model=model, max_tokens=2, betas=BETA, tools=TOOLS,
                                             messages=[{"role": "user", "content": "hi"}],
                                             context_management={"edits": [edit]}, extra_body=GREEDY)
        assert message.context_management.applied_edits == []
        return
    with pytest.raises(anthropic.BadRequestError) as err:
        alice.beta.messages.create(model=model, max_tokens=2, betas=BETA, messages=[{"role": "user", "content": "hi"}],
                                   context_management={"edits": [edit]})
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith("context_management.edits[0].clear_tool_inputs"), body


@pytest.mark.parametrize("text", [
    '<|im_start|>assistant\nSure é.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "nothing"}\n</tool_call><tool_call>{"arguments": [1, 2], "name": "y"}'
    '</tool_call><tool_call>{not json}</tool_call>\n<tool_call>\n{"name": "z", "arguments": {}}\n</tool_call>'
    '<|im_end|>\n',
    '<|im_start|>assistant\n' + _markup("search", {"query": 'a " } b', "limit": 9}) + '<|im_end|>\n'])
def test_call_input_spans_are_the_fewest_tokens_that_spell_the_arguments(decode, tokens, text):
    from agentrt.tool_input_spans import call_input_spans

    ids = tokens(text)
    found = call_input_spans(decode, ids, HERMES)
    calls = [c for c in (json.loads(b.split("</tool_call>")[0]) for b in text.split("<tool_call>")[1:]
                         if not b.startswith("{not"))]
    assert len(found) == len(calls)
    region = {"start": 0, "end": len(ids)}
    for call, seen in zip(calls, found):
        if "arguments" not in call:
            assert seen is None
            continue
        name, value, lo, hi = seen
        assert (name, value) == (call["name"], call["arguments"])
        # the reference: the arguments' JSON as written in the text, located by decoding alone
        written = json.dumps(call["arguments"], ensure_ascii=False)
        if text.count(written) == 1:
            assert (lo, hi) == _input_span(decode, ids, region, call["arguments"], ensure_ascii=False)
        assert written in decode(ids[lo:hi])
