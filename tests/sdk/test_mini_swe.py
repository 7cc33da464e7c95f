"""mini-swe-agent's DefaultAgent + LocalEnvironment through sdk.mini_swe against a live server (the random tiny
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
from sdk.mini_swe import AgentrtModel, HistoryError  # noqa: E402
from tests.server_helpers import ENGINE_OPTIONS  # noqa: E402

CONTENT = "hello from agentrt\n"
SCRIPT = [
    "THOUGHT: write the file.\n\n```mswea_bash_command\nprintf 'hello from agentrt\\n' > out.txt\n```",
    "THOUGHT: check it.\n\n```mswea_bash_command\ncat out.txt\n```",
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat out.txt\n```",
]
AGENT = {"system_template": "You are a shell agent.", "instance_template": "Task: {{task}}", "step_limit": 8}


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
    from engine.tiny_checkpoint import random_model_dir

    return create_app(ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS))


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

    from engine.tiny_checkpoint import random_model_dir

    return AutoTokenizer.from_pretrained(random_model_dir())


def scripted(tokenizer, script: list[str]):
    """send_options forcing reply ``turn`` to spell ``script[turn]``."""
    def options(turn: int, new_messages: list) -> dict:
        ids = tokenizer.encode(script[turn], add_special_tokens=False)
        return {"forced_token_ids": ids, "max_tokens": len(ids)}
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
    saved = agent.serialize()["info"]
    assert saved["agentrt"] == {"chain_ids": model.chain_ids, "num_recomputed": 0}
    assert saved["config"]["model_type"] == "sdk.mini_swe.AgentrtModel" and "api_key" not in saved["config"]["model"]

    messages = agent.messages  # system, task, then (assistant, observation) per step, exit
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 2 + ["assistant", "exit"]
    replies = [m for m in messages if m["role"] == "assistant"]
    assert [m["content"] for m in replies] == SCRIPT
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


def test_the_example_config_selects_the_adapter_and_runs_the_task(server, tokenizer, tmp_path):
    from pathlib import Path

    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment

    config = get_config_from_spec(Path(__file__).parents[2] / "examples" / "mini_swe_agent.yaml")
    model = get_model(config={**config["model"], "base_url": server.url})
    assert type(model) is AgentrtModel and model.config.sampling["max_tokens"] == 1024
    model.send_options = scripted(tokenizer, SCRIPT)
    env = get_environment({**config["environment"], "cwd": str(tmp_path)}, default_type="local")
    agent = DefaultAgent(model, env, **config["agent"])
    assert agent.run("create out.txt, then submit") == {"exit_status": "Submitted", "submission": CONTENT}
    assert (tmp_path / "out.txt").read_text() == CONTENT
    state = Client(server.url).chains.get(model.chain_ids[0]).info
    assert state.metadata == {"agent": "mini-swe-agent"} and state.num_turns == 3
    assert state.turns[0].messages == [UserMessage(content=agent.messages[1]["content"])]


def test_a_new_run_starts_a_new_chain(server, tokenizer, tmp_path):
    recorder = Recorder()
    model = make_model(server, tokenizer, SCRIPT, recorder)
    first = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path / "a")), **AGENT)
    second = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path / "b")), **AGENT)
    for agent, d in ((first, "a"), (second, "b")):
        (tmp_path / d).mkdir()
        assert agent.run(f"task {d}")["exit_status"] == "Submitted"
        assert (tmp_path / d / "out.txt").read_text() == CONTENT
    assert len(model.chain_ids) == 2 and model.chain_ids[0] != model.chain_ids[1]
    assert sum(1 for m, p, _ in recorder.sent if m == "POST" and p == "/v1/chains") == 2
    client = Client(server.url)
    for chain_id, agent in zip(model.chain_ids, (first, second)):
        state = client.chains.get(chain_id).info
        assert state.num_turns == 3 and state.turns[0].messages == [UserMessage(content=agent.messages[1]["content"])]
    assert [len(b["messages"]) for b in recorder.turn_bodies()] == [1] * 6


def test_a_reply_without_an_action_is_a_format_error_and_the_error_goes_as_a_user_message(server, tokenizer, tmp_path):
    script = ["I will not give a command.", *SCRIPT]
    recorder = Recorder()
    model = make_model(server, tokenizer, script, recorder, format_error_template="Format error: {{error}}")
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), **AGENT)
    assert agent.run("create out.txt, then submit")["exit_status"] == "Submitted"
    assert (tmp_path / "out.txt").read_text() == CONTENT
    error = agent.messages[2]
    assert error["role"] == "user" and error["content"] == "Format error: Expected exactly 1 action, found 0."
    assert error["extra"]["cost"] == 0.0 and error["extra"]["response"] == script[0]
    state = Client(server.url).chains.get(model.chain_ids[0]).info
    assert state.num_turns == 4 and state.turns[0].message.content == script[0]  # the chain keeps it
    assert state.turns[1].messages == [UserMessage(content=error["content"])]
    assert [r.kind for r in state.regions][:5] == ["system", "user", "assistant", "user", "assistant"]
    assert [len(b["messages"]) for b in recorder.turn_bodies()] == [1] * 4


def test_a_recomputed_chain_is_reported_and_the_run_continues(db_url, tokenizer, tmp_path):
    """The server restarts (same database, same port) in the middle of a run: the next turn is recomputed
    from the stored token log; the adapter still sends only the new message."""
    from agentrt.local_server import LocalServer

    recorder = Recorder()
    first = LocalServer(_app(db_url)).start()
    model = make_model(first, tokenizer, SCRIPT, recorder)
    env = LocalEnvironment(cwd=str(tmp_path))
    messages = [model.format_message(role="system", content="You are a shell agent."),
                model.format_message(role="user", content="Task: create out.txt")]
    reply = model.query(messages)
    messages += [reply, *model.format_observation_messages(reply, [env.execute(reply["extra"]["actions"][0])])]
    port = first.port
    first.stop()
    with LocalServer(_app(db_url), port=port) as second:
        again = model.query(messages)
        assert again["extra"]["agentrt"]["resume_status"] == "recomputed" and model.num_recomputed == 1
        assert again["extra"]["actions"] == [{"command": "cat out.txt"}]
        state = Client(second.url).chains.get(model.chain_ids[0]).info
    assert len(model.chain_ids) == 1 and state.num_turns == 2
    assert [t.resume_status for t in state.turns] == ["created", "recomputed"]
    (sent,) = state.turns[1].messages
    assert isinstance(sent, ToolResultMessage) and sent.content == messages[3]["content"]
    assert [len(b["messages"]) for b in recorder.turn_bodies()] == [1, 1]


TOOLCALL_SCRIPT = [
    "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"
    for command in ("printf 'hello from agentrt\\n' > out.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat out.txt")
]


def test_toolcall_mode_uses_the_calls_the_server_parsed(server, tokenizer, tmp_path):
    recorder = Recorder()
    model = make_model(server, tokenizer, TOOLCALL_SCRIPT, recorder, actions="toolcall")
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)), **AGENT)
    assert agent.run("create out.txt, then submit") == {"exit_status": "Submitted", "submission": CONTENT}
    assert (tmp_path / "out.txt").read_text() == CONTENT
    reply, observation = agent.messages[2], agent.messages[3]
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "bash" and reply["extra"]["actions"] == [
        {"command": "printf 'hello from agentrt\\n' > out.txt", "tool_call_id": call["id"]}]
    assert observation["role"] == "tool" and observation["tool_call_id"] == call["id"]
    state = Client(server.url).chains.get(model.chain_ids[0]).info
    assert [t.function.name for t in state.tools] == ["bash"]
    (sent,) = state.turns[1].messages
    assert isinstance(sent, ToolResultMessage) and sent.tool_call_id == call["id"]
    tool_region = next(r for r in state.regions if r.kind == "tool_result")
    assert (tool_region.tool_name, tool_region.tool_call_id) == ("bash", call["id"])


def test_bad_histories_are_refused_with_a_clear_error(server):
    model = AgentrtModel(base_url=server.url)
    with pytest.raises(HistoryError, match="starts with the system message"):
        model.query([{"role": "user", "content": "hi"}])
    with pytest.raises(HistoryError, match="starts with the system message"):
        model.query([{"role": "system", "content": "s"}])
    with pytest.raises(HistoryError, match="not generated by an agentrt chain"):
        model.query([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}])
    with pytest.raises(HistoryError, match="text messages only"):
        model.query([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(HistoryError, match="cannot send a 'developer' message"):
        model.query([{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}])
    assert model.chain_ids == []  # checked before anything is sent
