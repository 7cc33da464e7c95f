"""The server on a real PostgreSQL: a throwaway cluster (initdb, pg_ctl, createdb) on a loopback port in a
temp dir, removed afterwards. Migrations build the schema the models describe; chains, turns and regions
survive an app restart and the next turn recomputes; a turn whose commit fails leaves the database as it was."""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient
from sqlalchemy import Connection, text

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.db import current_revision, head_revision
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL
from tests.server.test_chain_leases import CHECKS
from tests.server.test_migrations import on_sync, open_and_close, schema_diffs

pytest.importorskip("asyncpg", reason="asyncpg is not installed (pip install -e '.[test]')")

SAMPLING = {"temperature": 0.0, "max_tokens": 6}
TURNS = ({"messages": [{"role": "user", "content": "Weather in Paris?"}], "assistant_prefix": TOOL_CALL},
         {"messages": [{"role": "tool", "tool_call_id": "call_x", "name": "get_weather", "content": '{"temp_c": 18}'}]},
         {"messages": [{"role": "user", "content": "Umbrella?"}]})
USER = "agentrt"


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """initdb refuses to run as root: as root, the cluster's commands run as the ``postgres`` user."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="agentrt-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no 'postgres' user to run the cluster as")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bin_dir / tool), *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"{tool} failed:\n{done.stdout}\n{done.stderr}"

    def start(self) -> str:
        self.run("initdb", "-D", str(self.data), "-U", USER, "-A", "trust", "--no-sync", "-E", "UTF8")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "agentrt_test")
        return f"postgresql+asyncpg://{USER}@127.0.0.1:{self.port}/agentrt_test"

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    cluster = Cluster(_bin_dir())
    try:
        yield cluster.start()
    finally:
        cluster.remove()


def _client(url: str) -> TestClient:
    config = ServerConfig(model=random_model_dir(), db_url=url, engine_options=ENGINE_OPTIONS)
    return TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60)


def _snapshot(conn: Connection) -> dict[str, list[tuple]]:
    return {t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY 1"))]
            for t in ("chains", "turns", "regions", "prune_events")}


FAIL_ON_CHAIN_UPDATE = (
    "CREATE FUNCTION agentrt_test_fail() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$ "
    "LANGUAGE plpgsql",
    "CREATE TRIGGER agentrt_test_fail BEFORE UPDATE ON chains FOR EACH ROW EXECUTE FUNCTION agentrt_test_fail()")


def _fail_chain_updates(conn: Connection) -> None:
    for statement in FAIL_ON_CHAIN_UPDATE:
        conn.execute(text(statement))


def test_migrations_build_the_models_schema_on_postgres(pg_url):
    open_and_close(pg_url)
    assert on_sync(pg_url, lambda c: c.dialect.name) == "postgresql"
    assert on_sync(pg_url, current_revision) == head_revision()
    assert on_sync(pg_url, schema_diffs) == []


def test_chains_survive_a_restart_and_a_failed_turn_changes_nothing(pg_url):
    with _client(pg_url) as http:
        r = http.post("/v1/chains", json={"tools": [WEATHER_TOOL], "metadata": {"db": "postgres"}})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        results = []
        for body in TURNS:
            r = http.post(f"/v1/chains/{cid}/turns", json={"sampling": SAMPLING, **body})
            assert r.status_code == 200, r.text
            results.append(r.json())
        assert [t["resume_status"] for t in results] == ["created", "resumed", "resumed"]
        before = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
    assert before["num_turns"] == 3 and len(before["token_ids"]) == before["num_tokens"]
    assert before["token_ids"] == [t for turn in before["turns"]
                                   for t in turn["appended_token_ids"] + turn["generated_token_ids"]]

    with _client(pg_url) as http:  # a new app and a new engine on the same database
        after = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
        for key in ("token_ids", "num_tokens", "turns", "regions", "metadata", "tools", "system_prompt"):
            assert after[key] == before[key], key
        assert after["kv"]["engine_status"] is None
        r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "Thanks"}],
                                                       "sampling": SAMPLING})
        assert r.status_code == 200, r.text
        fourth = r.json()
        assert fourth["turn"] == 3 and fourth["resume_status"] == "recomputed"
        assert fourth["usage"]["resumed_tokens"] == 0
        assert fourth["usage"]["prompt_tokens"] == before["num_tokens"] + fourth["usage"]["appended_tokens"]

        on_sync(pg_url, _fail_chain_updates)  # the turn's last statement fails
        try:
            rows = on_sync(pg_url, _snapshot)
            state = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
            r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "Bye"}],
                                                           "sampling": SAMPLING})
            assert r.status_code == 500, r.text
            assert on_sync(pg_url, _snapshot) == rows  # its turn and region inserts were rolled back too
            again = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
            assert {k: v for k, v in again.items() if k != "kv"} == {k: v for k, v in state.items() if k != "kv"}
        finally:
            on_sync(pg_url, lambda c: c.execute(text("DROP TRIGGER agentrt_test_fail ON chains")))
        r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "Bye"}],
                                                       "sampling": SAMPLING})
        assert r.status_code == 200, r.text
        assert r.json()["turn"] == 4
        final = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
        assert final["num_turns"] == 5 and final["token_ids"][: len(state["token_ids"])] == state["token_ids"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_chain_leases_on_postgres(pg_url, check):
    """The scale-out chain leases (agentrt.scaleout.leases) on PostgreSQL: its INSERT ... ON CONFLICT and
    UPDATE ... RETURNING, and concurrent acquires from many holders granting one."""
    open_and_close(pg_url)
    asyncio.run(check(pg_url))
