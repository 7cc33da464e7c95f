"""Closed-loop replay of agent traces against a running server: N sessions at once, each sending its next
turn when the previous one has finished and its think time has passed.

Two routes, both forcing the assistant to emit the trace's recorded tokens (``forced_token_ids``):

- ``stateless``: ``POST /v1/chat/completions`` with the whole conversation every turn (the assistant
  messages as recorded text), as an OpenAI-compatible agent does. Only the engine's prefix cache can
  save work: this is the "no Chain Cache" baseline.
- ``chain``: one chain per session (``sdk.AsyncClient``); each turn sends only the new messages over the
  chain's WebSocket, and the chain keeps its KV between turns (Chain Cache), optionally with a server-side
  pruning policy.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from agentrt.replay.trace import Trace, TraceMessage
from sdk.async_client import AsyncClient
from sdk.errors import AgentrtError
from sdk.schema import TurnDelta, TurnResult

Route = Literal["stateless", "chain"]


@dataclass(slots=True)
class ReplayConfig:
    """One configuration of the benchmark: the route, and what the server runs (``method``, prefix cache)."""

    name: str
    route: Route
    method: str = "dense"
    method_config: dict[str, Any] = field(default_factory=dict)
    prefix_cache: bool = True
    prune_policy: dict[str, Any] | None = None  # sdk.schema.PrunePolicy fields (chain route only)
    engine_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields of this configuration

    def __post_init__(self) -> None:
        if self.route not in ("stateless", "chain"):
            raise ValueError(f"route must be 'stateless' or 'chain', got {self.route!r}")
        if self.prune_policy is not None and self.route != "chain":
            raise ValueError(f"{self.name}: a prune policy needs the chain route")


@dataclass(slots=True)
class TurnRecord:
    session: int
    turn: int
    start: float  # seconds since the run began
    first_token: float
    end: float
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    resumed_tokens: int
    completion_tokens: int
    text: str  # what the server says it generated
    tokens_pruned: int = 0
    pages_peak: int = 0  # the most KV pages in use while the turn ran (filled from the samples)

    @property
    def ttft(self) -> float:
        return self.first_token - self.start


@dataclass(slots=True)
class RunResult:
    config: ReplayConfig
    wall_s: float
    turns: list[TurnRecord]
    samples: list[tuple[float, int]]  # (seconds since start, KV pages in use)
    counters: dict[str, float]  # the server's own /metrics counters, as differences over the run
    num_pages: int  # the KV pool's size


def _message(m: TraceMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
    return out


def last_request(trace: Trace) -> list[dict[str, Any]]:
    """The messages of the trace's last turn on the stateless route: the system prompt, then every turn's
    messages, each turn but the last followed by its recorded reply."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": trace.header.system_prompt}]
    for turn in trace.turns[:-1]:
        messages += [_message(m) for m in turn.messages] + [{"role": "assistant", "content": turn.output_text}]
    return messages + [_message(m) for m in trace.turns[-1].messages]


def context_tokens(renderer: Any, trace: Trace) -> int:
    """The tokens the trace's last turn holds when it ends, its prompt as ``renderer`` (the server's
    agentrt.chat.ChatRenderer) renders it plus its recorded output: what the model's max_model_len must hold."""
    return len(renderer.prompt(last_request(trace), trace.header.tools)) + len(trace.turns[-1].output_token_ids)


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition: ``name`` for unlabelled ones, ``name|k=v,...`` else."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}|{labels}" if labels else sample.name] = sample.value
    return out


STEP_KINDS = ("decode-graph", "decode-eager", "mixed", "prefill")
# chain tier moves whose wall seconds the server counts (agentrt_chain_tier_seconds): copies down, loads back from
# host memory and from disk, and turns' waits for asynchronous loads
TIER_MOVES = ("offload", "load_host", "load_disk", "load_wait")
COUNTERS = ("agentrt_tokens_prefilled_total", "agentrt_tokens_resumed_total", "agentrt_tokens_prefix_cached_total",
            "agentrt_tokens_generated_total", "agentrt_tokens_pruned_total",
            *(f"agentrt_engine_steps_total|kind={k}" for k in STEP_KINDS),
            *(f"agentrt_engine_step_seconds_by_kind_total|kind={k}" for k in STEP_KINDS),
            *(f"agentrt_chain_tier_seconds|move={m}" for m in TIER_MOVES))


class Replayer:
    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, think_scale: float = 1.0,
                 sample_interval_s: float = 0.05, timeout: float = 600.0):
        if think_scale < 0:
            raise ValueError("think_scale must be >= 0")
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.think_scale, self.sample_interval_s, self.timeout = think_scale, sample_interval_s, timeout

    async def run(self, traces: list[Trace], config: ReplayConfig) -> RunResult:
        """Replay ``traces`` (one session each, all at once) and measure."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, headers=headers) as http, \
                AsyncClient(self.base_url, api_key=self.api_key, timeout=self.timeout) as client:
            before = await self._metrics(http)
            samples: list[tuple[float, int]] = []
            t0 = time.perf_counter()
            stop = asyncio.Event()
            sampler = asyncio.create_task(self._sample(http, t0, samples, stop))
            try:
                sessions = [asyncio.create_task(self._stateless(http, i, t, t0) if config.route == "stateless"
                                                else self._chain(client, i, t, t0, config))
                            for i, t in enumerate(traces)]
                try:
                    per_session = await asyncio.gather(*sessions)
                except BaseException:
                    # one session failed (a refused turn): the others stop here, before their clients close under
                    # them, and the first failure is what the run reports
                    for task in sessions:
                        task.cancel()
                    await asyncio.gather(*sessions, return_exceptions=True)
                    raise
            finally:
                stop.set()
                await sampler
            wall = time.perf_counter() - t0
            after = await self._metrics(http)
        samples.append((wall, int(after.get("agentrt_kv_pages_used", 0))))
        turns = [r for records in per_session for r in records]
        for r in turns:
            r.pages_peak = max([p for t, p in samples if r.start <= t <= r.end + self.sample_interval_s] or [0])
        counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
        num_pages = int(after.get("agentrt_kv_pages_used", 0) + after.get("agentrt_kv_pages_free", 0))
        return RunResult(config, wall, turns, samples, counters, num_pages)

    async def _metrics(self, http: httpx.AsyncClient) -> dict[str, float]:
        response = await http.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    async def _sample(self, http: httpx.AsyncClient, t0: float, out: list[tuple[float, int]],
                      stop: asyncio.Event) -> None:
        while not stop.is_set():
            pages = (await self._metrics(http)).get("agentrt_kv_pages_used", 0)
            out.append((time.perf_counter() - t0, int(pages)))
            try:
                await asyncio.wait_for(stop.wait(), self.sample_interval_s)
            except TimeoutError:
                pass

    async def _think(self, seconds: float) -> None:
        if seconds * self.think_scale > 0:
            await asyncio.sleep(seconds * self.think_scale)

    async def _stateless(self, http: httpx.AsyncClient, session: int, trace: Trace, t0: float) -> list[TurnRecord]:
        h = trace.header
        messages: list[dict[str, Any]] = [{"role": "system", "content": h.system_prompt}]
        records = []
        for turn in trace.turns:
            messages += [_message(m) for m in turn.messages]
            # tool_choice "none": the text as generated, tool-call markup and all, is what the trace recorded
            body = {"model": self.model, "messages": messages, "tools": h.tools or None, "temperature": 0.0,
                    "max_tokens": len(turn.output_token_ids), "forced_token_ids": turn.output_token_ids,
                    "tool_choice": "none", "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter() - t0
            first, text, usage = None, [], None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise AgentrtError(f"session {session} turn {turn.index}: {response.text}",
                                       status_code=response.status_code)
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    for choice in chunk.get("choices", []):
                        delta = choice["delta"]
                        if delta.get("content"):
                            first = first if first is not None else time.perf_counter() - t0
                            text.append(delta["content"])
                    usage = chunk.get("usage") or usage
            end = time.perf_counter() - t0
            assert usage is not None, "the server sent no usage chunk"
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            records.append(TurnRecord(session, turn.index, start, first if first is not None else end, end,
                                      usage["prompt_tokens"], usage["prompt_tokens"] - cached, cached, 0,
                                      usage["completion_tokens"], "".join(text)))
            messages.append({"role": "assistant", "content": turn.output_text})
            await self._think(turn.think_time_s)
        return records

    async def _chain(self, client: AsyncClient, session: int, trace: Trace, t0: float,
                     config: ReplayConfig) -> list[TurnRecord]:
        h = trace.header
        chain = await client.chains.create(system_prompt=h.system_prompt, tools=h.tools,
                                           prune_policy=config.prune_policy,
                                           metadata={"trace": h.trace_id, "session": session})
        records = []
        try:
            for turn in trace.turns:
                sampling = {"temperature": 0.0, "max_tokens": len(turn.output_token_ids),
                            "forced_token_ids": turn.output_token_ids}
                start = time.perf_counter() - t0
                first, result = None, None
                async for item in chain.stream([_message(m) for m in turn.messages], sampling=sampling):
                    if isinstance(item, TurnDelta) and first is None:
                        first = time.perf_counter() - t0
                    elif isinstance(item, TurnResult):
                        result = item
                end = time.perf_counter() - t0
                assert result is not None
                u = result.usage
                records.append(TurnRecord(session, turn.index, start, first if first is not None else end, end,
                                          u.prompt_tokens, u.prefilled_tokens, u.cached_tokens, u.resumed_tokens,
                                          u.completion_tokens, result.message.content,
                                          sum(e.tokens_freed for e in result.pruned)))
                await self._think(turn.think_time_s)
        finally:
            await chain.delete()
        return records
