"""POST /v1/chat/completions without chain_id over implicit chains (agentrt.implicit_chains), through the official
``openai`` client: a conversation re-sent in full resumes its chain, conversations and tenants never resume each
other's, and greedy outputs equal the stateless path's (``logprobs`` keeps a request stateless)."""

from __future__ import annotations

import httpx
import pytest

from tests.live_servers import app_server, openai_client
from tests.server_helpers import bearer
from tests.tenant_servers import alice, bob, db_url, http, keys, server, tokens  # noqa: F401 (fixtures)

MODEL = "qwen3-tiny"  # the embedded model's name
GREEDY = {"temperature": 0, "max_tokens": 6}
SYSTEM = {"role": "system", "content": "You are terse."}


def _ask(client, messages, **kw):
    """(completion, chain id or None): the chain id from the response's ``chain`` (absent when stateless)."""
    r = client.chat.completions.create(model=MODEL, messages=messages, **{**GREEDY, **kw})
    chain = (r.model_extra or {}).get("chain")
    return r, chain["id"] if chain else None


def _chain(http, key, chain_id) -> dict:
    r = http.get(f"/v1/chains/{chain_id}?include_tokens=true", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _reply(r) -> dict:
    return {"role": "assistant", "content": r.choices[0].message.content or ""}


def test_a_conversation_resent_in_full_resumes_one_chain(alice, http, keys):
    history: list = [SYSTEM, {"role": "user", "content": "Count with me."}]
    ids, replies = [], []
    for step in range(4):
        r, cid = _ask(alice, history)
        stateless, none = _ask(alice, history, logprobs=True)  # a chain turn carries no logprobs: stateless
        assert none is None
        assert r.choices[0].message.content == stateless.choices[0].message.content  # greedy: the same reply
        assert r.usage.prompt_tokens == stateless.usage.prompt_tokens
        ids.append(cid)
        replies.append(r)
        history += [_reply(r), {"role": "user", "content": f"Step {step}."}]
    assert ids[0] is not None and len(set(ids)) == 1
    chain = _chain(http, keys["alice"], ids[0])
    assert chain["num_turns"] == 4 and "agentrt_implicit" in chain["metadata"]
    assert [t["messages"] for t in chain["turns"]] == \
        [[m] for m in history[1:-1] if m["role"] == "user"]
    for r, turn in zip(replies, chain["turns"]):
        used = turn["usage"]
        assert r.usage.prompt_tokens == used["prompt_tokens"]
        assert r.usage.prompt_tokens_details.cached_tokens == used["prompt_tokens"] - used["prefilled_tokens"]
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    for r, turn in zip(replies[1:], chain["turns"][1:]):
        assert turn["resume_status"] == "resumed"
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1  # only the new part
        assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_a_tool_calling_conversation_resumes_its_chain(alice, http, keys, tokens):
    forced = tokens('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    history: list = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    first, cid = _ask(alice, history, tools=tools, max_tokens=len(forced), extra_body={"forced_token_ids": forced})
    (tc,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and tc.function.name == "get_weather"
    history += [first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": tc.id, "content": '{"temp_c": 18}'}]
    second, cid2 = _ask(alice, history, tools=tools)
    history += [_reply(second), {"role": "user", "content": "And tomorrow?"}]
    third, cid3 = _ask(alice, history, tools=tools)
    assert cid == cid2 == cid3
    stateless, _ = _ask(alice, history, tools=tools, logprobs=True)
    assert third.choices[0].message.content == stateless.choices[0].message.content
    chain = _chain(http, keys["alice"], cid)
    assert chain["num_turns"] == 3 and [t["resume_status"] for t in chain["turns"][1:]] == ["resumed"] * 2
    assert chain["turns"][1]["messages"][0]["role"] == "tool"


def test_streamed_requests_resume_the_chain_and_match_the_non_streamed(alice):
    history: list = [SYSTEM, {"role": "user", "content": "Streamed conversation."}]
    ids = []
    for step in range(2):
        chunks = list(alice.chat.completions.create(model=MODEL, messages=history, stream=True,
                                                    stream_options={"include_usage": True}, **GREEDY))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        (final,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        ids.append(final.model_extra["chain"]["id"])
        assert chunks[-1].usage is not None
        plain, _ = _ask(alice, history, prompt_cache_key="plain")  # its own session: a chain of its own
        assert text == (plain.choices[0].message.content or "")
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    assert len(set(ids)) == 1


def test_interleaved_conversations_never_resume_each_others_chain(alice, http, keys):
    a: list = [{"role": "user", "content": "First conversation."}]
    b: list = [{"role": "user", "content": "Second conversation."}]
    chains: dict[str, set] = {"a": set(), "b": set()}
    for step in range(3):
        for name, history in (("a", a), ("b", b)):
            r, cid = _ask(alice, history)
            chains[name].add(cid)
            history += [_reply(r), {"role": "user", "content": f"{name} step {step}"}]
    assert len(chains["a"]) == len(chains["b"]) == 1 and chains["a"] != chains["b"]
    for name, history in (("a", a), ("b", b)):
        chain = _chain(http, keys["alice"], next(iter(chains[name])))
        assert [m["content"] for t in chain["turns"] for m in t["messages"]] == \
            [m["content"] for m in history[:-1] if m["role"] == "user"]
    # identical conversations told apart by their session keys: prompt_cache_key, else user
    for field in ("prompt_cache_key", "user"):
        same = {"s1": [{"role": "user", "content": f"Same words ({field})."}],
                "s2": [{"role": "user", "content": f"Same words ({field})."}]}
        seen: dict[str, set] = {"s1": set(), "s2": set()}
        for step in range(2):
            for session, history in same.items():
                r, cid = _ask(alice, history, **{field: session})
                seen[session].add(cid)
                history += [_reply(r), {"role": "user", "content": "Again."}]
        assert len(seen["s1"]) == len(seen["s2"]) == 1 and seen["s1"] != seen["s2"]


def test_another_tenant_never_resumes_the_chain(alice, bob, http, keys):
    history: list = [{"role": "user", "content": "Tenant-scoped prefix."}]
    r, alice_chain = _ask(alice, history)
    history += [_reply(r), {"role": "user", "content": "Go on."}]
    r_bob, bob_chain = _ask(bob, history)
    assert bob_chain is not None and bob_chain != alice_chain
    chain = _chain(http, keys["bob"], bob_chain)
    assert chain["turns"][-1]["resume_status"] != "resumed" or chain["num_turns"] == 2  # imported, then its turn
    assert http.get(f"/v1/chains/{alice_chain}", headers=bearer(keys["bob"])).status_code == 404
    r2, alice_again = _ask(alice, history)
    assert alice_again == alice_chain  # alice's chain was left for alice
    assert r2.choices[0].message.content == r_bob.choices[0].message.content


@pytest.mark.parametrize("option", [{"implicit_chains": False}, {"max_chains_per_tenant": 0}],
                         ids=["option-off", "no-room-for-a-chain"])
def test_the_option_off_or_a_tenant_at_its_chain_limit_keeps_requests_stateless(tmp_path, option):
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 's.db'}", **option) as s:
        client = openai_client(s.url)
        history: list = [SYSTEM, {"role": "user", "content": "Stateless."}]
        r, cid = _ask(client, history)
        assert cid is None and r.choices[0].message.content is not None
        with httpx.Client(base_url=s.url) as http:
            assert http.get("/v1/chains").json()["data"] == []
