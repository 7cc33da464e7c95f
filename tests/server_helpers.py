"""Shared pieces of the server tests: engine options, API keys, a reference engine loop, SSE parsing."""

from __future__ import annotations

import asyncio
import json

ENGINE_OPTIONS = {"device": "cpu", "num_pages": 1024}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make_keys(db_url: str, *tenants: str) -> dict[str, str]:
    """Keys created through the same service the CLI uses (``agentrt keys create``)."""
    from agentrt.auth import KeyService
    from agentrt.db import open_database

    async def run() -> dict[str, str]:
        db = await open_database(db_url)
        try:
            service = KeyService(db)
            return {t: (await service.create(t)).key for t in tenants}
        finally:
            await db.dispose()

    return asyncio.run(run())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make_engine(model_dir):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_dir, **ENGINE_OPTIONS))


def generate_direct(engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy generation on a bare engine: the independent check of what the server generated."""
    from engine import SamplingParams

    rid = engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)
    raise AssertionError("request did not finish")


def post_turn(client, cid: str, body: dict) -> dict:
    r = client.post(f"/v1/chains/{cid}/turns", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def weather_tool_round(client, cid: str, sampling: dict) -> tuple[dict, dict]:
    """An agent's first two turns on a chain: the user's question answered with a tool call (forced through
    ``assistant_prefix``), then the tool's result."""
    first = post_turn(client, cid, {"sampling": sampling, "assistant_prefix": TOOL_CALL,
                                    "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    call = first["message"]["tool_calls"][0]
    second = post_turn(client, cid, {"sampling": sampling, "messages": [
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18}'}]})
    return first, second


def sse_events(lines) -> list[tuple[str, dict]]:
    events, name = [], "message"
    for line in lines:
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line.split(":", 1)[1].strip())))
            name = "message"
    return events
