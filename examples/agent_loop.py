"""The SDK's agent loop (``sdk.Agent``) with two tools, against ``agentrt serve``.

    agentrt serve                                  # the embedded tiny model on 127.0.0.1:8000
    python examples/agent_loop.py --scripted       # or --url http://HOST:PORT, --api-key KEY

``Agent`` turns the tool calls the server parsed from each reply into tool-result turns until a reply has no
call. The embedded model (trained on long-context retrieval, not on tool use) does not call these tools by
itself: ``--scripted`` starts the first two replies with a tool call (an assistant prefix; generation continues after it), so both tools run.
With a real model, leave it off.
"""

from __future__ import annotations

import argparse
import json
import sys

from sdk import Agent, Client, Transcript

CITIES = {"paris": {"temp_c": 18.0, "sky": "clear"}, "oslo": {"temp_c": -3.0, "sky": "snow"}}
SCRIPT = [{"name": "get_weather", "arguments": {"city": "Oslo"}},
          {"name": "celsius_to_fahrenheit", "arguments": {"celsius": -3.0}}]

agent = Agent()


@agent.tool
def get_weather(city: str) -> dict:
    """Current weather for a city."""
    return {"city": city, **CITIES[city.lower()]}


@agent.tool
def celsius_to_fahrenheit(celsius: float) -> float:
    """A temperature in degrees Fahrenheit."""
    return celsius * 9 / 5 + 32


def scripted_prefix(turn: int) -> str | None:
    if turn < len(SCRIPT):
        return f"<tool_call>\n{json.dumps(SCRIPT[turn])}\n</tool_call>"
    return None


def run(client: Client, scripted: bool, max_tokens: int) -> Transcript:
    chain = client.chains.create(system_prompt="You are a weather agent. Use the tools.", tools=agent.tools(),
                                 prune_policy={"lag": 1}, metadata={"example": "agent_loop"})
    transcript = agent.run(chain, "How cold is it in Oslo, in Fahrenheit?", max_rounds=4,
                           assistant_prefix=scripted_prefix if scripted else None, max_tokens=max_tokens)
    print(f"chain {chain.id}: {len(transcript.turns)} turns, finished={transcript.finished}")
    print(f"{'turn':>4} {'status':>10} {'appended':>8} {'prefilled':>9} {'resumed':>7}  tool calls -> results")
    results = iter(m for m in transcript.messages if getattr(m, "tool_call_id", None))
    for t in transcript.turns:
        calls = [f"{c.function.name}({c.function.arguments}) -> {next(results).content}" for c in t.message.tool_calls]
        u = t.usage
        print(f"{t.turn:>4} {t.resume_status:>10} {u.appended_tokens:>8} {u.prefilled_tokens:>9} "
              f"{u.resumed_tokens:>7}  {'; '.join(calls) or '-'}")
    return transcript


def main(argv: list[str] | None = None) -> Transcript:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--scripted", action="store_true", help="start the first two replies with a tool call")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    with Client(args.url, api_key=args.api_key) as client:
        return run(client, args.scripted, args.max_tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
