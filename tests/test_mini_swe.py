"""mini-swe-agent's DefaultAgent + LocalEnvironment through sdk.mini_swe against a live server (the embedded tiny
model). The replies are forced token sequences (the scripted text, tokenized with the model's tokenizer), so
the agent's actions really run; the server's stored turns and a recording transport show what was sent."""

from __future__ import annotations

import json
import os

import httpx
import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (pip install 'agentrt[swe]')")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models import get_model  # noqa: E402

from sdk import Client, ToolResultMessage, UserMessage  # noqa: E402
from sdk.mini_swe import AgentrtModel  # noqa: E402
from sdk.schema import Sampling  # noqa: E402
from tests.server_helpers import ENGINE_OPTIONS  # noqa: E402

CONTENT = "hello from agentrt\n"
SCRIPT = [
    "THOUGHT: write the file.\n\n```mswea_bash_command\nprintf 'hello from agentrt\\n' > out.txt\n```",
    "THOUGHT: check it.\n\n```mswea_bash_command\ncat out.txt\n```",
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat out.txt\n```",
]
AGENT = {"system_template": "You are a shell agent.", "instance_template": "Task: {{task}}", "step_limit": 8}
WIRE_FORCED = "forced_token_ids" in Sampling.__struct_fields__


class Recorder(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, request.url.path, body))
        return super().handle_request(request)

    def turn_bodies(self) -> list[dict]:
        return [b for m, p, b in self.sent if m == "POST" and p.endswith("/turns")]


def _app(db_url: str):
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from engine.tiny_checkpoint import default_model_dir

    return create_app(ServerConfig(model=default_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS))


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('mswe') / 'server.db'}"


@pytest.fixture(scope="module")
def server(db_url):
    from agentrt.local_server import LocalServer

    with LocalServer(_app(db_url)) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.tiny_checkpoint import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def scripted(tokenizer, script: list[str]):
    """send_options forcing reply ``turn`` to spell ``script[turn]``."""
    def options(turn: int, new_messages: list) -> dict:
        ids = tokenizer.encode(script[turn], add_special_tokens=False)
        if WIRE_FORCED:
            return {"forced_token_ids": ids, "max_tokens": len(ids)}
        return {"assistant_prefix": script[turn], "max_tokens": 1}  # the wire has no forced tokens yet
    return options


def make_model(server, tokenizer, script, recorder=None, **config):
    client = Client(server.url, timeout=60, transport=recorder)
    return AgentrtModel(client=client, send_options=scripted(tokenizer, script), **config)


def test_default_agent_completes_a_scripted_task_sending_only_new_messages(server, tokenizer, tmp_path):
    recorder = Recorder()
    model = make_model(server, tokenizer, SCRIPT, recorder)
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), **AGENT)
    result = agent.run("create out.txt holding 'hello from agentrt', then submit")

    assert (tmp_path / "out.txt").read_text() == CONTENT
    assert result == {"exit_status": "Submitted", "submission": CONTENT}
    assert agent.cost == 0.0 and agent.n_calls == 3 and len(model.chain_ids) == 1

    messages = agent.messages  # system, task, then (assistant, observation) per step, exit
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 2 + ["assistant", "exit"]
    replies = [m for m in messages if m["role"] == "assistant"]
    if WIRE_FORCED:
        assert [m["content"] for m in replies] == SCRIPT
    else:
        assert all(m["content"].startswith(s) for m, s in zip(replies, SCRIPT, strict=True))
    assert [m["extra"]["actions"] for m in replies] == [
        [{"command": "printf 'hello from agentrt\\n' > out.txt"}], [{"command": "cat out.txt"}],
        [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat out.txt"}]]
    assert CONTENT in messages[5]["content"]  # the `cat` observation

    state = Client(server.url).chains.get(model.chain_ids[0], include_tokens=True).info
    assert state.system_prompt == messages[0]["content"] and state.num_turns == 3
    observations = [messages[3], messages[5]]
    assert state.turns[0].messages == [UserMessage(content=messages[1]["content"])]
    for turn, obs in zip(state.turns[1:], observations):
        (sent,) = turn.messages
        assert isinstance(sent, ToolResultMessage) and sent.content == obs["content"] and sent.name == "bash"
    if WIRE_FORCED:
        expected = [tokenizer.encode(s, add_special_tokens=False) for s in SCRIPT]
        assert [t.generated_token_ids for t in state.turns] == expected
    assert [r.kind for r in state.regions] == ["system", "user", "assistant"] + ["tool_result", "assistant"] * 2
    tool_regions = [r for r in state.regions if r.kind == "tool_result"]
    assert [(r.tool_name, r.round) for r in tool_regions] == [("bash", 0), ("bash", 1)]
    assert [t.resume_status for t in state.turns] == ["created", "resumed", "resumed"]

    creates = [b for m, p, b in recorder.sent if m == "POST" and p == "/v1/chains"]
    assert creates == [{"system_prompt": messages[0]["content"]}]
    bodies = recorder.turn_bodies()
    assert [b["messages"] for b in bodies] == [
        [{"role": "user", "content": messages[1]["content"]}],
        *[[{"role": "tool", "content": o["content"], "tool_call_id": f"bash-{i + 1}-0", "name": "bash"}]
          for i, o in enumerate(observations)]]
