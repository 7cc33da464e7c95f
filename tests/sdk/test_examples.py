"""examples/agent_loop.py against a live server on the embedded default model (uvicorn in a thread)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdk import Client, ToolResultMessage
from tests.server_helpers import ENGINE_OPTIONS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer

    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('examples') / 'server.db'}"
    with LocalServer(create_app(ServerConfig(db_url=db, engine_options=ENGINE_OPTIONS))) as s:  # model=None
        yield s


@pytest.fixture(scope="module")
def agent_loop():
    spec = importlib.util.spec_from_file_location("agent_loop_example", EXAMPLES / "agent_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_loop_runs_both_tools_and_the_policy_prunes_the_older_result(server, agent_loop, capsys):
    transcript = agent_loop.main(["--url", server.url, "--scripted", "--max-tokens", "8"])
    assert transcript.finished and len(transcript.turns) == 3
    calls = [c for t in transcript.turns for c in t.message.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("celsius_to_fahrenheit", {"celsius": -3.0})]
    results = [m for m in transcript.messages if isinstance(m, ToolResultMessage)]
    assert [r.tool_call_id for r in results] == [c.id for c in calls]
    assert json.loads(results[0].content) == {"city": "Oslo", "temp_c": -3.0, "sky": "snow"}
    assert json.loads(results[1].content) == pytest.approx(-3.0 * 1.8 + 32)
    assert [t.resume_status for t in transcript.turns] == ["created", "resumed", "resumed"]

    state = Client(server.url).chains.get(transcript.turns[0].chain_id).info
    tools = [(r.tool_name, r.round, r.pruned) for r in state.regions if r.kind == "tool_result"]
    assert tools == [("get_weather", 0, True), ("celsius_to_fahrenheit", 1, False)]  # lag 1
    assert [e.source for e in transcript.turns[2].pruned] == ["policy"]
    out = capsys.readouterr().out
    assert f"chain {state.id}: 3 turns, finished=True" in out and "-> 26.6" in out


def test_agent_loop_without_the_script_is_one_turn_on_the_default_model(server, agent_loop):
    """The embedded default model was not trained to call these tools: one turn, at most --max-tokens long."""
    transcript = agent_loop.main(["--url", server.url, "--max-tokens", "8"])
    (turn,) = transcript.turns
    assert transcript.finished and 1 <= turn.usage.completion_tokens <= 8 and not turn.message.tool_calls


def test_agent_loop_runs_as_a_script(server):
    done = subprocess.run([sys.executable, str(EXAMPLES / "agent_loop.py"), "--url", server.url, "--scripted"],
                          capture_output=True, text=True, timeout=120, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stderr
    assert "3 turns, finished=True" in done.stdout and "get_weather" in done.stdout
