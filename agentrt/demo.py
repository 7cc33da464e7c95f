"""`agentrt demo`: a scripted eight-turn, tool-using agent session through the SDK, with a lag-2 pruning policy.

The server starts in-process on the embedded model and a SQLite file in a temporary directory. The agent
checks the weather of four cities, one tool call per turn (the calls are supplied as assistant prefixes,
so the session is the same whatever the model writes after them), then asks three follow-up questions. The
chain keeps its KV between turns, so each turn prefills only its new tokens; once a fifth tool result
arrives the policy has pruned the oldest rounds. One table row per turn: the tokens the turn appended,
prefilled and resumed, the KV pages the chain holds afterwards, and the tokens its policy pruned; a legend
under the table says what each column means.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sdk import Client
from sdk.schema import TurnResult

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and a three-day forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = {"Paris": (18, "clear"), "Oslo": (-3, "snow"), "Rome": (24, "sunny"), "Lisbon": (21, "windy")}
FOLLOW_UPS = ["Which of these cities is the warmest?", "Where will I need a coat?",
              "Thanks! Summarise the trip plan in one line."]
LAG = 2
LEGEND = f"""
  status     created: the turn that started the chain; resumed: the turn reused the KV the chain kept;
             recomputed: the chain's KV had been reclaimed, so the turn computed it again
  new        tokens the turn appended to the chain: its messages and the assistant header, as the chat
             template renders them
  prefilled  tokens whose KV the turn computed: from turn 1 on, new + 1, because the previous reply's last
             token was sampled but never fed back through the model, so its KV is computed with the new ones
  resumed    tokens whose KV the chain kept from earlier turns (reused, not recomputed)
  pages      KV pages the chain holds after the turn (16 tokens each on the in-process server)
  pruned     tokens the lag-{LAG} policy freed in the turn: the tool result {LAG} rounds behind the one
             the turn appended
  reply      every turn's messages are scripted, and so are the tool calls of turns 0-3 (sent as assistant
             prefixes, so the session is the same whatever the model writes after them); from turn 4 on the
             reply is the model's own (at most --max-tokens tokens)"""


@dataclass(slots=True)
class DemoRow:
    turn: int
    status: str
    appended: int
    prefilled: int
    resumed: int
    pages: int
    pruned: int
    reply: str


def _call(city: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "\n</tool_call>"


def _weather(city: str) -> str:
    temp, sky = CITIES[city]
    forecast = [{"day": d, "temp_c": temp + i, "sky": sky, "wind_kmh": 10 + 3 * i} for i, d in
                enumerate(["mon", "tue", "wed"])]
    return json.dumps({"city": city, "temp_c": temp, "sky": sky, "forecast": forecast})


def run_session(client: Client, max_tokens: int = 16) -> list[DemoRow]:
    chain = client.chains.create(system_prompt="You are a travel agent. Check the weather before you answer.",
                                 tools=[WEATHER_TOOL], prune_policy={"lag": LAG}, metadata={"demo": True})
    print(f"chain {chain.id} on {chain.info.model} (method {chain.info.method}, pruning policy lag {LAG})")
    rows: list[DemoRow] = []

    def record(result: TurnResult) -> TurnResult:
        u = result.usage
        calls = [f"{c.function.name}({json.loads(c.function.arguments)['city']})" for c in result.message.tool_calls]
        rows.append(DemoRow(result.turn, result.resume_status, u.appended_tokens, u.prefilled_tokens,
                            u.resumed_tokens, chain.state().kv.pages, sum(e.tokens_freed for e in result.pruned),
                            "call " + ", ".join(calls) if calls else repr(result.message.content)))
        return result

    cities = list(CITIES)
    result = record(chain.send("Plan a trip to " + ", ".join(cities) + ": what weather should I expect?",
                               assistant_prefix=_call(cities[0]), max_tokens=max_tokens))
    for i, city in enumerate(cities):
        call = result.message.tool_calls[0]
        following = _call(cities[i + 1]) if i + 1 < len(cities) else None
        result = record(chain.send(tool_results=[(call, _weather(city))], assistant_prefix=following,
                                   max_tokens=max_tokens))
    for question in FOLLOW_UPS:
        record(chain.send(question, max_tokens=max_tokens))
    _print(rows)
    state = chain.state()
    tools = [r for r in state.regions if r.kind == "tool_result"]
    print(f"tool results: {sum(r.pruned for r in tools)} of {len(tools)} rounds pruned; the chain holds "
          f"{state.kv.physical_tokens} of its {state.kv.computed_tokens} computed tokens in {state.kv.pages} pages")
    return rows


def _print(rows: list[DemoRow]) -> None:
    print(f"\n{'turn':>4} {'status':>10} {'new':>5} {'prefilled':>9} {'resumed':>7} {'pages':>5} {'pruned':>6}  reply")
    for r in rows:
        reply = r.reply if len(r.reply) <= 48 else r.reply[:45] + "..."
        print(f"{r.turn:>4} {r.status:>10} {r.appended:>5} {r.prefilled:>9} {r.resumed:>7} {r.pages:>5} "
              f"{r.pruned:>6}  {reply}")
    print(LEGEND)


def run(url: str | None = None, max_tokens: int = 16) -> list[DemoRow]:
    """The session against ``url``, or against a server started in-process (embedded model, SQLite)."""
    if url is not None:
        with Client(url) as client:
            return run_session(client, max_tokens)
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer

    with tempfile.TemporaryDirectory(prefix="agentrt-demo-") as tmp:
        config = ServerConfig(db_url=f"sqlite+aiosqlite:///{Path(tmp) / 'demo.db'}", engine_options={"num_pages": 2048})
        print("starting the server in-process on the embedded model...")
        with LocalServer(create_app(config)) as server, Client(server.url) as client:
            print(f"serving at {server.url}")
            return run_session(client, max_tokens)


def main(url: str | None = None, max_tokens: int = 16) -> int:
    run(url, max_tokens)
    return 0
