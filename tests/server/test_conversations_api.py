"""OpenAI's Conversations API (agentrt.conversations) through the official ``openai`` package against a live server
on the embedded model, with auth on: a conversation is a chain, ``responses.create(conversation=...)`` its next
turn (only the new part prefilled), its items read back from the chain's turns (in order, paged, one by one, with
the ids the responses gave them), added items taken by the next response, added assistant items imported as
turns, a function call's output added as an item, deletion (a pending item; not a past turn's; the conversation
and its chain), another tenant's conversation a 404, bad input a 400 naming the field, the items after a
restart, and a thinking model's reasoning items read back as its responses returned them."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.live_servers import app_server, openai_client
from tests.server_helpers import bearer
from tests.tenant_servers import alice, bob, db_url, http, keys, server, tokens  # noqa: F401 (fixtures)

MODEL = "qwen3-tiny"  # the embedded model's name
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _ask(client, conversation, input, forced=None, stream=False, **kw):
    """The response (a stream's final one); ``forced``: its tokens (the reply's text, exactly)."""
    kw = {"model": MODEL, "input": input, "conversation": conversation, "temperature": 0, "max_output_tokens": 4,
          **kw}
    if forced is not None:
        kw.update(max_output_tokens=len(forced), extra_body={"forced_token_ids": forced})
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def _chain(http, key, conversation_id) -> dict:
    r = http.get(f"/v1/chains/chain_{conversation_id.removeprefix('conv_')}?include_tokens=true", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _shown(items) -> list[tuple]:
    out = []
    for i in items:
        if i.type == "message":
            out.append((i.role, i.content[0].text))
        elif i.type == "function_call":
            out.append(("call", i.name, i.arguments))
        else:
            out.append((i.type, i.call_id, i.output))
    return out


def test_a_conversation_round_trip(alice, http, keys, tokens):
    conv = alice.conversations.create(items=[_user("My name is Ann.")], metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "names"}
    assert alice.conversations.retrieve(conv.id) == conv
    assert _chain(http, keys["alice"], conv.id)["num_turns"] == 0  # its chain, the item pending

    first = _ask(alice, conv.id, "What is my name?", forced=tokens("You are Ann."))
    assert first.conversation.id == conv.id and first.output[0].content[0].text == "You are Ann."
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = _ask(alice, {"id": conv.id}, "Are you sure?", stream=True, forced=tokens("Quite sure."))
    assert second.conversation.id == conv.id and second.output[0].content[0].text == "Quite sure."

    chain = _chain(http, keys["alice"], conv.id)
    assert [t["messages"] for t in chain["turns"]] == [
        [{"role": "user", "content": "My name is Ann."}, {"role": "user", "content": "What is my name?"}],
        [{"role": "user", "content": "Are you sure?"}]]
    turn = chain["turns"][1]  # the chain's KV resumed: only the new part (and the token the KV lacks) prefilled
    assert turn["resume_status"] == "resumed"
    assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
    assert second.usage.input_tokens_details.cached_tokens == \
        turn["usage"]["prompt_tokens"] - turn["usage"]["prefilled_tokens"] > 0

    # the items, oldest first: the user items and the responses' output, with the responses' ids
    items = alice.conversations.items.list(conv.id, order="asc").data
    assert _shown(items) == [("user", "My name is Ann."), ("user", "What is my name?"), ("assistant", "You are Ann."),
                             ("user", "Are you sure?"), ("assistant", "Quite sure.")]
    assert [items[2].id, items[4].id] == [first.output[0].id, second.output[0].id]
    assert [i.id for i in alice.conversations.items.list(conv.id).data] == [i.id for i in reversed(items)]  # desc
    page = alice.conversations.items.list(conv.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in items[:2]] and page.has_more
    rest = alice.conversations.items.list(conv.id, order="asc", limit=2, after=page.last_id)
    assert [i.id for i in rest.data] == [i.id for i in items[2:4]]
    assert [i.id for i in alice.conversations.items.list(conv.id, order="asc", limit=2)] == \
        [i.id for i in items]  # the client's auto-paging (after=last_id until has_more is false)
    got = alice.conversations.items.retrieve(items[2].id, conversation_id=conv.id)
    assert got == items[2]

    # an added item is taken by the next response, before its input; a pending one can be deleted
    added = alice.conversations.items.create(conv.id, items=[_user("One more thing.")])
    doomed = alice.conversations.items.create(conv.id, items=[_user("Never mind.")]).data[0]
    assert alice.conversations.items.delete(doomed.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.retrieve(doomed.id, conversation_id=conv.id)
    third = _ask(alice, conv.id, "Go on.", forced=tokens("Done."))
    assert _chain(http, keys["alice"], conv.id)["turns"][2]["messages"] == [
        {"role": "user", "content": "One more thing."}, {"role": "user", "content": "Go on."}]
    items = alice.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.id for i in items[-3:]] == [added.data[0].id, items[-2].id, third.output[0].id]
    assert _shown(items[-3:]) == [("user", "One more thing."), ("user", "Go on."), ("assistant", "Done.")]
    # the response's input items carry the conversation's ids
    assert client_input_ids(alice, third) == [items[-2].id]

    # an item of a past turn is in the chain's KV: refused, naming item_id
    with pytest.raises(openai.BadRequestError) as err:
        alice.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert err.value.param == "item_id" and "rewind" in err.value.message

    updated = alice.conversations.update(conv.id, metadata={"topic": "done"})
    assert updated.metadata == {"topic": "done"} == alice.conversations.retrieve(conv.id).metadata

    deleted = alice.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conv.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.list(conv.id)
    with pytest.raises(openai.NotFoundError):
        _ask(alice, conv.id, "Hello?")
    r = http.get(f"/v1/chains/chain_{conv.id.removeprefix('conv_')}", headers=bearer(keys["alice"]))
    assert r.status_code == 404  # its chain is gone


def client_input_ids(client, response) -> list[str]:
    return [i.id for i in client.responses.input_items.list(response.id).data]


def test_function_calls_and_imported_history(alice, http, keys, tokens):
    # a conversation opened with a history: the assistant's items are imported as a turn of the chain
    conv = alice.conversations.create(items=[
        {"type": "message", "role": "system", "content": "You are terse."}, _user("Hi"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello! Weather?"}]},
        _user("Yes, in Paris.")])
    given = [i.id for i in alice.conversations.items.list(conv.id, order="asc").data]  # pending: no turn yet
    assert len(given) == 4
    call = _ask(alice, conv.id, "Please.", tools=[WEATHER], forced=tokens(CALL))
    (fc,) = call.output
    assert (fc.type, fc.name, fc.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')
    # the call's output, added as an item, is the next turn's tool message (tools left out: the chain's)
    alice.conversations.items.create(conv.id, items=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp_c": 18}'}])
    _ask(alice, conv.id, "Thanks.", forced=tokens("Mild."))
    chain = _chain(http, keys["alice"], conv.id)
    assert chain["system_prompt"] == "You are terse." and [t["function"]["name"] for t in chain["tools"]] == \
        ["get_weather"]
    assert [t["messages"] for t in chain["turns"]] == [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Yes, in Paris."}, {"role": "user", "content": "Please."}],
        [{"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": fc.call_id, "name": "get_weather"},
         {"role": "user", "content": "Thanks."}]]
    assert chain["turns"][2]["resume_status"] == "resumed"
    items = alice.conversations.items.list(conv.id, order="asc", limit=100).data
    assert _shown(items) == [
        ("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello! Weather?"), ("user", "Yes, in Paris."),
        ("user", "Please."), ("call", "get_weather", '{"city": "Paris"}'),
        ("function_call_output", fc.call_id, '{"temp_c": 18}'), ("user", "Thanks."), ("assistant", "Mild.")]
    assert items[5].id == fc.id and items[5].call_id == fc.call_id
    assert [i.id for i in items[:4]] == given  # the items given at creation keep their ids once taken
    # instructions after the first turn: repeated or left out
    with pytest.raises(openai.BadRequestError) as err:
        _ask(alice, conv.id, "Again.", instructions="Be verbose.")
    assert err.value.param == "instructions"


def test_tenants_and_bad_input(alice, bob, http, keys):
    conv = alice.conversations.create(items=[_user("secret")])
    for call in (lambda: bob.conversations.retrieve(conv.id), lambda: bob.conversations.items.list(conv.id),
                 lambda: bob.conversations.items.create(conv.id, items=[_user("x")]),
                 lambda: bob.conversations.update(conv.id, metadata={}), lambda: bob.conversations.delete(conv.id),
                 lambda: _ask(bob, conv.id, "tell me"),
                 lambda: alice.conversations.retrieve("conv_" + "0" * 32),
                 lambda: alice.conversations.retrieve("nonsense"),
                 lambda: _ask(alice, "conv_" + "0" * 32, "hi")):
        with pytest.raises(openai.NotFoundError):
            call()
    item = alice.conversations.items.list(conv.id).data[0]
    with pytest.raises(openai.NotFoundError):
        bob.conversations.items.retrieve(item.id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.retrieve("msg_nope", conversation_id=conv.id)
    # an ordinary chain is not a conversation
    chain = http.post("/v1/chains", json={}, headers=bearer(keys["alice"])).json()["id"]
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(f"conv_{chain.removeprefix('chain_')}")

    first = _ask(alice, conv.id, "hi")
    cases = [
        (lambda: _ask(alice, conv.id, "hi", previous_response_id=first.id), "previous_response_id"),
        (lambda: _ask(alice, 5, "hi"), "conversation"),
        (lambda: alice.conversations.items.create(conv.id, items=[{"type": "web_search_call", "id": "x"}]),
         "items[0].type"),
        (lambda: alice.conversations.items.create(conv.id, items=[{"type": "message", "role": "system",
                                                                   "content": "late"}]), "items[0].role"),
        (lambda: alice.conversations.items.create(conv.id, items=[{"type": "reasoning", "summary": []}]),
         "items[0].type"),
        (lambda: alice.conversations.items.create(conv.id, items=[_user("x")] * 21), "items"),
        (lambda: alice.conversations.items.create(conv.id, items=[{"type": "message", "role": "assistant",
                                                                   "content": "out of turn"}]), "items[0]"),
        (lambda: alice.conversations.create(metadata={str(i): "v" for i in range(17)}), "metadata"),
        (lambda: alice.conversations.create(items=[{"type": "message", "role": "user", "content": "x",
                                                    "bogus": 1}]), "items[0]"),
        (lambda: alice.conversations.items.list(conv.id, after="msg_nope"), "after"),
        (lambda: alice.conversations.items.list(conv.id, limit=0), "limit"),
        (lambda: _ask(alice, conv.id, [{"type": "message", "role": "assistant", "content": "me?"}]), "input"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert (err.value.param or "").startswith(param), (param, err.value.body)
        assert err.value.type == "invalid_request_error"
    # nothing changed: the conversation still takes its next turn
    assert _ask(alice, conv.id, "still there?").conversation.id == conv.id


def test_items_survive_a_restart(tmp_path, tokens):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'restart.db'}"
    with app_server(db_url) as s:
        client = openai_client(s.url)
        conv = client.conversations.create(items=[_user("Remember 42.")], metadata={"k": "v"})
        reply = _ask(client, conv.id, "What number?", forced=tokens("42."))
        client.conversations.items.create(conv.id, items=[_user("And twice that?")])
        before = client.conversations.items.list(conv.id, order="asc").data
    with app_server(db_url) as s:  # the map conversation -> chain -> items is the chain's rows
        client = openai_client(s.url)
        assert client.conversations.retrieve(conv.id).metadata == {"k": "v"}
        assert client.conversations.items.list(conv.id, order="asc").data == before
        assert before[2].id == reply.output[0].id
        again = _ask(client, conv.id, "Say it.", forced=tokens("84."))
        after = client.conversations.items.list(conv.id, order="asc").data
        assert _shown(after[len(before):]) == [("user", "Say it."), ("assistant", "84.")]
        assert after[:len(before)] == before and again.output[0].id == after[-1].id


def test_a_thinking_models_items_are_its_responses_output(tmp_path):
    """Reasoning items, read back from the chain's turns, equal the responses' output: a think block the model
    opened, one the generation prompt opened (``reasoning.effort``), one cut off, none (effort "none")."""
    from tests.server.test_reasoning import CONTINUED, END, GENERATED, _thinking_model

    model_dir = _thinking_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids(END)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'think.db'}", model=model_dir) as s:
        client = openai_client(s.url)
        model = client.models.list().data[0].id
        conv = client.conversations.create()
        output = []
        for input, forced, kw in (
                ("Hello", encode(GENERATED) + [end], {}),
                ("And?", encode(CONTINUED) + [end], {"reasoning": {"effort": "medium"}}),
                ("Cut", encode(GENERATED)[:6], {}),
                ("Quick", encode("Plain.") + [end], {"reasoning": {"effort": "none"}})):
            r = _ask(client, conv.id, input, forced=forced, model=model, **kw)
            output += [o.model_dump(exclude_unset=True) for o in r.output]
        items = client.conversations.items.list(conv.id, order="asc", limit=100).data
        assert [o["type"] for o in output] == ["reasoning", "message", "reasoning", "message", "reasoning",
                                               "message"]  # the cut reply is all reasoning, the last has none
        assert [i.model_dump(exclude_unset=True) for i in items if getattr(i, "role", None) != "user"] == output
