"""Responses are rows of the database (agentrt.models.ResponseRow, agentrt.responses), written with their chain
turn: after a server restart over the same database (SQLite, and a throwaway PostgreSQL cluster where its binaries
are installed) ``GET /v1/responses/{id}``, ``input_items``, ``DELETE`` and ``previous_response_id`` (the latest
response: the chain's next turn; an older one: a fork) answer as before it, streamed responses included;
``store: false`` stays unretrievable but can be continued; another tenant's id stays a 404; deleting the chain or
the conversation deletes its responses; a turn whose commit fails stores no response; and the revision that
adds the table applies to a database at the revision before it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from alembic import command
from sqlalchemy import Connection, inspect, text

from agentrt.db import alembic_config, current_revision, head_revision
from agentrt.responses import responses_service
from tests.live_servers import app_server, openai_client
from tests.server.test_migrations import _insert_first_revision_rows, on_sync, schema_diffs
from tests.server_helpers import bearer, make_keys

N = 4  # max_output_tokens
NUL_TOKEN = 188  # the embedded model's byte-0 token
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
FORCED = {"type": "function", "name": "get_weather"}
PREVIOUS_REVISION = "0003"  # the revision before the one that adds the responses table


@pytest.fixture(scope="module")
def pg_cluster_url() -> Iterator[str]:
    pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install -e '.[test]')")
    from tests.server.test_postgres import Cluster, _bin_dir

    cluster = Cluster(_bin_dir())
    try:
        yield cluster.start()
    finally:
        cluster.remove()


def _empty(conn: Connection) -> None:
    conn.execute(text("DROP SCHEMA public CASCADE"))
    conn.execute(text("CREATE SCHEMA public"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'responses.db'}"
    url = request.getfixturevalue("pg_cluster_url")
    on_sync(url, _empty)  # each test starts from an empty schema, as on SQLite
    return url


def _ask(client, input, **kw):
    return client.responses.create(model=kw.pop("model", "qwen3-tiny"), input=input,
                                   **{"temperature": 0, "max_output_tokens": N, **kw})


def _rows(db_url: str) -> dict[str, tuple]:
    """The responses table: id -> (tenant, chain_id, turn, stored)."""
    return on_sync(db_url, lambda c: {r[0]: tuple(r[1:]) for r in c.execute(text(
        "SELECT id, tenant, chain_id, turn, stored FROM responses"))})


def _chain(http: httpx.Client, key: str, chain_id: str) -> dict:
    r = http.get(f"/v1/chains/{chain_id}", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _read(http: httpx.Client, key: str, response_id: str) -> tuple[dict, list[dict]]:
    """The response as GET returns it, and its input items listed in each order and page by page."""
    def get(path: str, **params) -> dict:
        r = http.get(f"/v1/responses/{response_id}{path}", params=params, headers=bearer(key))
        assert r.status_code == 200, r.text
        return r.json()

    pages = [get("/input_items", order=order) for order in ("asc", "desc")]
    pages.append(get("/input_items", order="asc", limit=1))
    pages.append(get("/input_items", order="asc", limit=1, after=pages[-1]["first_id"]))
    return get(""), pages


def test_responses_survive_a_restart(db_url):
    keys = make_keys(db_url, "alice", "bob")
    with app_server(db_url, require_auth=True) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        alice = openai_client(s.url).with_options(api_key=keys["alice"])
        call = _ask(alice, "Weather in Oslo?", instructions="Be brief.", tools=[WEATHER], tool_choice=FORCED,
                    max_output_tokens=64, metadata={"k": "v"})
        fc = next(o for o in call.output if o.type == "function_call")
        answer = _ask(alice, [{"type": "function_call", "call_id": fc.call_id, "name": fc.name,
                               "arguments": fc.arguments},
                              {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"},
                              {"role": "user", "content": "Umbrella?"}], previous_response_id=call.id)
        streamed = list(alice.responses.create(model="qwen3-tiny", input="Thanks", previous_response_id=answer.id,
                                               temperature=0, max_output_tokens=N, stream=True))[-1].response
        nul = _ask(alice, "Say NUL", extra_body={"forced_token_ids": [NUL_TOKEN]}, max_output_tokens=1)
        hidden = _ask(alice, "Secret", store=False, prompt_cache_key="hidden")
        stored = (call, answer, streamed, nul)
        before = {r.id: _read(http, keys["alice"], r.id) for r in stored}
    assert "\x00" in nul.output_text and before[nul.id][0]["output"][0]["content"][0]["text"] == nul.output_text
    assert [o["id"] for o in before[streamed.id][0]["output"]] == [o.id for o in streamed.output]
    assert before[answer.id][1][0]["data"][0]["type"] == "function_call"
    rows = _rows(db_url)
    chain_id = rows[call.id][1]
    assert [rows[r.id][1:] for r in (call, answer, streamed)] == [(chain_id, t, True) for t in range(3)]
    assert rows[hidden.id][0] == "alice" and rows[hidden.id][3] in (False, 0)

    with app_server(db_url, require_auth=True) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        assert not responses_service(s.app.state).records  # nothing carried over in memory
        alice = openai_client(s.url).with_options(api_key=keys["alice"])
        bob = openai_client(s.url).with_options(api_key=keys["bob"])
        for r in stored:
            assert _read(http, keys["alice"], r.id) == before[r.id]
        # another tenant's responses are not there
        for read in (bob.responses.retrieve, bob.responses.input_items.list, bob.responses.delete):
            with pytest.raises(openai.NotFoundError):
                read(call.id)
        with pytest.raises(openai.BadRequestError) as err:
            _ask(bob, "Hi", previous_response_id=answer.id)
        assert err.value.code == "previous_response_not_found"
        # store: false is still not retrievable, and still continues its chain
        for read in (alice.responses.retrieve, alice.responses.input_items.list, alice.responses.delete):
            with pytest.raises(openai.NotFoundError):
                read(hidden.id)
        follow = _ask(alice, "More", previous_response_id=hidden.id)
        hidden_chain = _chain(http, keys["alice"], rows[hidden.id][1])
        assert hidden_chain["num_turns"] == 2 and hidden_chain["turns"][1]["messages"][0]["content"] == "More"
        assert hidden_chain["turns"][1]["resume_status"] == "recomputed"  # the restart dropped the KV
        assert follow.usage.input_tokens_details.cached_tokens == 0
        # the latest response: the chain's next turn; an older one: a fork rewound to it
        latest = _ask(alice, "Go on", previous_response_id=streamed.id)
        branch = _ask(alice, "Other", previous_response_id=answer.id)
        assert latest.instructions == "Be brief." and latest.tools[0].name == "get_weather"
        chain = _chain(http, keys["alice"], chain_id)
        assert chain["num_turns"] == 4 and chain["turns"][3]["messages"][0]["content"] == "Go on"
        rows = _rows(db_url)
        assert rows[latest.id][1:3] == (chain_id, 3)
        fork = _chain(http, keys["alice"], rows[branch.id][1])
        assert rows[branch.id][1] != chain_id and rows[branch.id][2] == 2
        assert [t["messages"][-1]["content"] for t in fork["turns"]] == ["Weather in Oslo?", "Umbrella?", "Other"]
        # DELETE forgets the response (its turn stays)
        alice.responses.delete(answer.id)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(answer.id)
        with pytest.raises(openai.BadRequestError) as err:
            _ask(alice, "Again", previous_response_id=answer.id)
        assert err.value.code == "previous_response_not_found"
        assert answer.id not in _rows(db_url) and _chain(http, keys["alice"], chain_id)["num_turns"] == 4


def test_deleting_the_chain_or_the_conversation_deletes_its_responses(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'deleted.db'}"
    with app_server(db_url) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        client = openai_client(s.url)
        first = _ask(client, "Hello")
        second = _ask(client, "And?", previous_response_id=first.id)
        branch = _ask(client, "Or?", previous_response_id=first.id)  # a fork: a chain of its own
        hidden = _ask(client, "Psst", store=False, previous_response_id=second.id)
        rows = _rows(db_url)
        chain_id = rows[first.id][1]
        assert rows[second.id][1] == rows[hidden.id][1] == chain_id != rows[branch.id][1]
        assert http.delete(f"/v1/chains/{chain_id}").status_code == 204
        for r in (first, second):  # not served from memory either
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, "Still?", previous_response_id=hidden.id)
        assert err.value.code == "previous_response_not_found"
        assert set(_rows(db_url)) == {branch.id}
        assert client.responses.retrieve(branch.id).id == branch.id

        conv = client.conversations.create()
        said = _ask(client, "Hi", conversation=conv.id)
        assert client.responses.retrieve(said.id).conversation.id == conv.id
        client.conversations.delete(conv.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(said.id)
        assert set(_rows(db_url)) == {branch.id}


FAIL_ON_CHAIN_UPDATE = ("CREATE TRIGGER agentrt_test_fail BEFORE UPDATE ON chains "
                        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END")


def test_a_turn_whose_commit_fails_stores_no_response(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'failed.db'}"
    with app_server(db_url) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        client = openai_client(s.url)
        first = _ask(client, "Hello")
        rows = _rows(db_url)
        chain_id = rows[first.id][1]
        on_sync(db_url, lambda c: c.execute(text(FAIL_ON_CHAIN_UPDATE)))  # the turn's last statement fails
        try:
            with pytest.raises(openai.InternalServerError):
                _ask(client, "More", previous_response_id=first.id)
            events = list(client.responses.create(model="qwen3-tiny", input="More", previous_response_id=first.id,
                                                  temperature=0, max_output_tokens=N, stream=True))
            assert events[-1].type == "error"
            assert _rows(db_url) == rows
            assert http.get(f"/v1/chains/{chain_id}").json()["num_turns"] == 1
        finally:
            on_sync(db_url, lambda c: c.execute(text("DROP TRIGGER agentrt_test_fail")))
        more = _ask(client, "More", previous_response_id=first.id)
        assert _rows(db_url)[more.id][1:3] == (chain_id, 1)


def test_the_revision_applies_to_a_database_at_the_previous_revision(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    on_sync(db_url, lambda c: command.upgrade(alembic_config(connection=c), PREVIOUS_REVISION))
    on_sync(db_url, _insert_first_revision_rows)
    assert "responses" not in on_sync(db_url, lambda c: inspect(c).get_table_names())
    with app_server(db_url) as s:  # migrated on open
        client = openai_client(s.url)
        r = _ask(client, "Hello")
        assert client.responses.retrieve(r.id).output_text == r.output_text
    assert on_sync(db_url, current_revision) == head_revision()
    assert on_sync(db_url, schema_diffs) == []
    on_sync(db_url, lambda c: command.downgrade(alembic_config(connection=c), PREVIOUS_REVISION))
    assert "responses" not in on_sync(db_url, lambda c: inspect(c).get_table_names())
    chains = on_sync(db_url, lambda c: [r[0] for r in c.execute(text("SELECT id FROM chains ORDER BY created_at"))])
    assert chains[0] == "chain_a" and len(chains) == 2  # the rows from before, and the response's chain
    assert on_sync(db_url, lambda c: c.execute(text("SELECT count(*) FROM turns")).scalar()) == 2
