"""NUL and other values a database may refuse, on SQLite and on a throwaway PostgreSQL cluster alike.

PostgreSQL's ``text`` cannot hold NUL. Client-given names and prompts holding one are 400s naming the field;
a chain id holding one is a 404; generated text (the embedded model's token 188 is the byte 0, forced here
through ``sampling.forced_token_ids``) is stored losslessly (``agentrt.models.NulSafeText``), read back
byte-exact, also by a new app on the same database, and both databases store the same escaped value. A list
offset past what a database takes is a 400 naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from alembic import command
from litestar.testing import TestClient
from sqlalchemy import Connection, select, text

from agentrt.app import create_app
from agentrt.config import ServerConfig, embedded_model_dir
from agentrt.db import alembic_config, open_database
from agentrt.models import NUL_MARK, ChainRow, RegionRow, TurnRow, escape_nul, unescape_nul
from engine.llm_engine import load_tokenizer
from tests.server_helpers import ENGINE_OPTIONS, WEATHER_TOOL
from tests.server.test_migrations import on_sync

NUL = "\x00"
USER = [{"role": "user", "content": "Weather in Paris?"}]
NUL_TOKEN = 188  # the embedded model's byte-0 token


@pytest.fixture(scope="module")
def pg_cluster_url() -> Iterator[str]:
    pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install -e '.[test]')")
    from tests.server.test_postgres import Cluster, _bin_dir

    cluster = Cluster(_bin_dir())
    try:
        yield cluster.start()
    finally:
        cluster.remove()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'nul.db'}"
    url = request.getfixturevalue("pg_cluster_url")
    on_sync(url, _empty)  # each test starts from an empty schema, as on SQLite
    return url


def _empty(conn: Connection) -> None:
    conn.execute(text("DROP SCHEMA public CASCADE"))
    conn.execute(text("CREATE SCHEMA public"))


def client(url: str) -> TestClient:  # model None: the embedded default model
    return TestClient(base_url="http://127.0.0.1", app=create_app(ServerConfig(db_url=url, engine_options=ENGINE_OPTIONS)), timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_dir())


def post_turn(http, cid: str, body: dict) -> dict:
    r = http.post(f"/v1/chains/{cid}/turns", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chain_state(http, cid: str) -> dict:
    state = http.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    return {k: v for k, v in state.items() if k not in ("kv", "status")}


@pytest.mark.parametrize("route,body,key", [
    ("create", {"system_prompt": f"You are{NUL} terse."}, "system_prompt"),
    ("create", {"tools": [{"type": "function", "function": {"name": f"get{NUL}weather"}}]},
     "tools[0].function.name"),
    ("create", {"prune_policy": {"exclude_tools": ["search", f"a{NUL}"]}}, "prune_policy.exclude_tools[1]"),
    ("turn", {"messages": USER, "assistant_prefix": f"Sure{NUL}"}, "assistant_prefix"),
    ("turn", {"messages": [{"role": "tool", "tool_call_id": f"call{NUL}1", "content": "18"}]},
     "messages[0].tool_call_id"),
    ("turn", {"messages": USER + [{"role": "tool", "tool_call_id": "call_1", "name": f"get{NUL}", "content": "1"}]},
     "messages[1].name"),
])
def test_nul_in_client_names_and_prompts_is_a_400_naming_the_field(db_url, route, body, key):
    with client(db_url) as http:
        cid = http.post("/v1/chains", json={"tools": [WEATHER_TOOL]}).json()["id"]
        before = chain_state(http, cid), http.get("/v1/chains").json()["total"]
        path = "/v1/chains" if route == "create" else f"/v1/chains/{cid}/turns"
        r = http.post(path, json={**body, **({"sampling": {"max_tokens": 2}} if route == "turn" else {})})
        assert r.status_code == 400, r.text
        assert [d["key"] for d in r.json()["extra"]] == [key] and "NUL" in r.json()["detail"]
        assert (chain_state(http, cid), http.get("/v1/chains").json()["total"]) == before
        assert post_turn(http, cid, {"messages": USER, "sampling": {"max_tokens": 2}})["turn"] == 0


def test_a_chain_id_with_nul_is_404_on_every_route(db_url):
    with client(db_url) as http:
        missing = http.get("/v1/chains/chain_nope").json()
        for method, path, body in (("GET", "", None), ("DELETE", "", None),
                                   ("POST", "/turns", {"messages": USER}), ("POST", "/prune", {"intervals": [[0, 1]]}),
                                   ("POST", "/fork", {}), ("POST", "/rewind", {"num_turns": 0})):
            r = http.request(method, f"/v1/chains/chain_%00x{path}", json=body)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["detail"] == missing["detail"].replace("chain_nope", "chain_\\x00x")
        with http.websocket_connect("/v1/chains/%00/ws") as ws:
            ws.send_json({"messages": USER})
            assert ws.receive_json()["status_code"] == 404
        assert http.get("/health").status_code == 200


def test_message_content_with_nul_is_kept(db_url):
    """Message content is stored as JSON (``\\u0000`` on both databases): tool output may hold NUL."""
    with client(db_url) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        post_turn(http, cid, {"messages": [{"role": "user", "content": f"a{NUL}b"}], "sampling": {"max_tokens": 2}})
        assert chain_state(http, cid)["turns"][0]["messages"][0]["content"] == f"a{NUL}b"


def test_generated_nul_is_stored_and_read_back_byte_exact(db_url, tokenizer):
    """The generated text starts with the escape mark and holds NUL, ``%00`` and ``%25``: the turn commits,
    reads back as generated, survives a new app on the database, and the next turn renders it."""
    forced = (tokenizer.encode(NUL_MARK, add_special_tokens=False) + [NUL_TOKEN]
              + tokenizer.encode("%00%25", add_special_tokens=False) + [NUL_TOKEN])
    expected = f"{NUL_MARK}{NUL}%00%25{NUL}"
    assert tokenizer.decode(forced) == expected
    with client(db_url) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        first = post_turn(http, cid, {"messages": USER, "sampling": {"max_tokens": len(forced),
                                                                     "forced_token_ids": forced}})
        assert first["message"]["content"] == expected and first["finish_reason"] == "length"
        before = chain_state(http, cid)
        assert before["turns"][0]["message"]["content"] == expected
        assert before["turns"][0]["generated_token_ids"] == forced
    stored = on_sync(db_url, lambda c: c.execute(text("SELECT content FROM turns")).scalar_one())
    assert stored == escape_nul(expected) and NUL not in stored  # the same escaped value on either database
    with client(db_url) as http:  # a new app and engine: everything from the database
        assert chain_state(http, cid) == before
        second = post_turn(http, cid, {"messages": USER, "sampling": {"max_tokens": 2}})
        assert second["resume_status"] == "recomputed"
        after = chain_state(http, cid)
        assert after["token_ids"][: len(before["token_ids"])] == before["token_ids"]
        assert after["turns"][0] == before["turns"][0]


def test_a_generated_tool_name_with_nul_is_stored_in_its_region(db_url):
    """A tool call's name comes from generated text (JSON's ``\\u0000`` is NUL once parsed); the tool result
    answering it without a name takes that name into its region."""
    prefix = '<tool_call>\n{"name": "get\\u0000weather", "arguments": {}}\n</tool_call>'
    with client(db_url) as http:
        cid = http.post("/v1/chains", json={"tools": [WEATHER_TOOL]}).json()["id"]
        first = post_turn(http, cid, {"messages": USER, "assistant_prefix": prefix, "sampling": {"max_tokens": 2}})
        (call,) = first["message"]["tool_calls"]
        assert call["function"]["name"] == f"get{NUL}weather"
        long_id = "c" * 256  # the longest tool_call_id a request may carry (regions held 255 characters)
        post_turn(http, cid, {"messages": [{"role": "tool", "tool_call_id": call["id"], "content": "18"},
                                           {"role": "tool", "tool_call_id": long_id, "content": "19"}],
                              "sampling": {"max_tokens": 2}})
        tools = [(r["tool_name"], r["tool_call_id"]) for r in chain_state(http, cid)["regions"]
                 if r["kind"] == "tool_result"]
        assert tools == [(f"get{NUL}weather", call["id"]), (None, long_id)]
    with client(db_url) as http:
        again = [(r["tool_name"], r["tool_call_id"]) for r in chain_state(http, cid)["regions"]
                 if r["kind"] == "tool_result"]
        assert again == tools


@pytest.mark.parametrize("query,key", [("offset=9223372036854775808", "offset"), ("offset=2147483648", "offset"),
                                       ("offset=-1", "offset"), ("limit=9223372036854775808", "limit"),
                                       ("limit=0", "limit")])
def test_list_offset_and_limit_out_of_range_are_400_naming_them(db_url, query, key):
    with client(db_url) as http:
        r = http.get(f"/v1/chains?{query}")
        assert r.status_code == 400, r.text
        assert [d["key"] for d in r.json()["extra"]] == [key]
        assert http.get("/v1/chains?offset=2147483647&limit=100").json()["data"] == []


@pytest.mark.parametrize("value", ["", NUL, NUL * 3, "%", "%00", "%25", "%2500", f"%{NUL}", NUL_MARK,
                                   f"{NUL_MARK}%00", f"{NUL_MARK}{NUL}", f"a{NUL_MARK}{NUL}", "plain \\x00 text",
                                   f"{NUL}{NUL_MARK}%25%{NUL}%00"])
def test_the_escape_is_reversible_and_leaves_plain_text_alone(value):
    stored = escape_nul(value)
    assert NUL not in stored and unescape_nul(stored) == value
    if NUL not in value and not value.startswith(NUL_MARK):
        assert stored == value


def test_rows_written_before_the_escape_read_back_as_written(db_url):
    """Revision 0003 rewrites the values that start with the mark, written as they were before it."""
    on_sync(db_url, lambda c: command.upgrade(alembic_config(connection=c), "0002"))
    written = f"{NUL_MARK}%00 as written, no NUL"

    def insert(conn: Connection) -> None:
        conn.execute(text(
            "INSERT INTO chains (id, created_at, model, method, method_config, system_prompt, tools, meta, "
            "num_turns, num_tokens, pruned_intervals) VALUES ('chain_a', 1.5, 'tiny', 'dense', '{}', :s, '[]', "
            "'{}', 1, 1, '[]')"), {"s": written})
        conn.execute(text(
            "INSERT INTO turns (chain_id, \"index\", created_at, messages, sampling, content, tool_calls, "
            "finish_reason, resume_status, appended_token_ids, generated_token_ids, usage) VALUES ('chain_a', 0, "
            "2.0, '[]', '{}', :s, '[]', 'stop', 'created', :b, :b, '{}')"), {"s": written, "b": b""})
        conn.execute(text(
            "INSERT INTO regions (chain_id, \"index\", kind, start, \"end\", turn, tool_name, tool_call_id, pruned, "
            "kept_tokens) VALUES ('chain_a', 0, 'tool_result', 0, 1, 0, :s, 'plain', false, 1)"), {"s": written})

    on_sync(db_url, insert)

    async def read() -> tuple:
        db = await open_database(db_url)  # upgrades to head
        try:
            async with db.sessions() as s:
                return ((await s.get(ChainRow, "chain_a")).system_prompt,
                        (await s.scalars(select(TurnRow))).one().content,
                        (await s.scalars(select(RegionRow))).one().tool_name)
        finally:
            await db.dispose()

    assert asyncio.run(read()) == (written, written, written)
    on_sync(db_url, lambda c: command.downgrade(alembic_config(connection=c), "0002"))
    assert on_sync(db_url, lambda c: c.execute(text("SELECT content FROM turns")).scalar_one()) == written
