"""`agentrt demo`: a scripted three-turn agent conversation with one tool call, over HTTP.

The embedded model is random, so its words are noise: the tool call is supplied as an assistant prefix
(generation continues after it) and parsed from the turn's text like any generated call.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _show(turn: int, result: dict) -> None:
    usage = result["usage"]
    print(f"assistant[{turn}]: {result['message']['content']!r}")
    for call in result["message"]["tool_calls"]:
        print(f"  tool call {call['id']}: {call['function']['name']}({call['function']['arguments']})")
    print(f"  usage: prompt {usage['prompt_tokens']}, appended {usage['appended_tokens']}, prefilled "
          f"{usage['prefilled_tokens']}, resumed {usage['resumed_tokens']}, prefix-cached {usage['cached_tokens']}, "
          f"generated {usage['completion_tokens']}; status {result['resume_status']}")


def run_script(client: httpx.Client, max_tokens: int = 24) -> dict:
    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
    chain = client.post("/v1/chains", json={"system_prompt": "You are a weather agent.", "tools": [WEATHER_TOOL],
                                            "metadata": {"demo": True}}).raise_for_status().json()
    chain_id = chain["id"]
    print(f"chain {chain_id} on {chain['model']} (method {chain['method']})")

    def turn(body: dict) -> dict:
        return client.post(f"/v1/chains/{chain_id}/turns", json={"sampling": sampling, **body}).raise_for_status().json()

    print("user[0]: What is the weather in Paris?")
    first = turn({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                  "assistant_prefix": TOOL_CALL})
    _show(0, first)
    call = first["message"]["tool_calls"][0]
    weather = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "clear"})
    print(f"tool[{call['id']}]: {weather}")
    _show(1, turn({"messages": [{"role": "tool", "tool_call_id": call["id"], "content": weather}]}))
    print("user[2]: Thanks! Should I take an umbrella?")
    _show(2, turn({"messages": [{"role": "user", "content": "Thanks! Should I take an umbrella?"}]}))
    state = client.get(f"/v1/chains/{chain_id}").raise_for_status().json()
    print(f"chain: {state['num_turns']} turns, {state['num_tokens']} tokens, regions:")
    for r in state["regions"]:
        tool = f" {r['tool_name']} round {r['round']}" if r["kind"] == "tool_result" else ""
        print(f"  [{r['start']:4d}, {r['end']:4d}) {r['kind']}{tool} (turn {r['turn']})")
    return state


def main(url: str | None = None, max_tokens: int = 24) -> int:
    if url is not None:
        with httpx.Client(base_url=url, timeout=120) as client:
            run_script(client, max_tokens)
        return 0
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer

    with tempfile.TemporaryDirectory(prefix="agentrt-demo-") as tmp:
        config = ServerConfig(db_url=f"sqlite+aiosqlite:///{Path(tmp) / 'demo.db'}", engine_options={"num_pages": 2048})
        print("starting the server in-process on the embedded tiny model...")
        with LocalServer(create_app(config)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            print(f"serving at {server.url}")
            run_script(client, max_tokens)
    return 0
