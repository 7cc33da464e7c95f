"""The replay report: one summary per configuration (JSON-ready dicts) and a printed table."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from agentrt.replay.replayer import STEP_KINDS, TIER_MOVES, RunResult


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def per_turn(run: RunResult, attr: str) -> list[float]:
    """The mean over sessions of ``attr`` at each turn index."""
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in run.turns:
        by_turn[r.turn].append(getattr(r, attr))
    return [statistics.fmean(by_turn[i]) for i in sorted(by_turn)]


def summarize(run: RunResult) -> dict[str, Any]:
    ttft = [r.ttft for r in run.turns]
    latency = [r.end - r.start for r in run.turns]  # a turn from its request to its last token
    sessions = len({r.session for r in run.turns})
    c = run.counters
    return {
        "config": run.config.name, "route": run.config.route, "method": run.config.method,
        "method_config": run.config.method_config, "prefix_cache": run.config.prefix_cache,
        "prune_policy": run.config.prune_policy,
        "sessions": sessions, "turns": len(run.turns),
        "wall_s": round(run.wall_s, 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 5) if ttft else 0.0,
        "ttft_p50_s": round(_pct(ttft, 0.5), 5), "ttft_p90_s": round(_pct(ttft, 0.9), 5),
        "turn_p50_s": round(_pct(latency, 0.5), 5), "turn_p90_s": round(_pct(latency, 0.9), 5),
        # what a session spent waiting for the server (its turns' latencies; think time excluded), on average
        "wait_s": round(sum(latency) / sessions, 4) if sessions else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in run.turns),
        "prefilled_tokens": int(c["agentrt_tokens_prefilled_total"]),  # the server's counters
        "prefix_cached_tokens": int(c["agentrt_tokens_prefix_cached_total"]),
        "resumed_tokens": int(c["agentrt_tokens_resumed_total"]),
        "generated_tokens": int(c["agentrt_tokens_generated_total"]),
        "pruned_kv_slots": int(c["agentrt_tokens_pruned_total"]),
        "prefilled_tokens_from_usage": sum(r.prefilled_tokens for r in run.turns),
        "peak_kv_pages": max((p for _, p in run.samples), default=0),
        "kv_pool_pages": run.num_pages,
        "prefilled_per_turn": [round(x, 1) for x in per_turn(run, "prefilled_tokens")],
        "kv_pages_per_turn": [round(x, 1) for x in per_turn(run, "pages_peak")],
        "ttft_per_turn_s": [round(x, 5) for x in per_turn(run, "ttft")],
        # the engine's forward steps by kind, and the wall seconds they took (where the run's time went)
        "engine_steps": {k: int(c.get(f"agentrt_engine_steps_total|kind={k}", 0)) for k in STEP_KINDS},
        "engine_step_seconds": {k: round(c.get(f"agentrt_engine_step_seconds_by_kind_total|kind={k}", 0.0), 3)
                                for k in STEP_KINDS},
        # wall seconds of chain tier moves (loads started on a side stream count their launch only; load_wait
        # is the time their turns waited parked for the copies)
        "tier_seconds": {m: round(c.get(f"agentrt_chain_tier_seconds|move={m}", 0.0), 3) for m in TIER_MOVES},
    }


SPREAD_KEYS = ("wall_s", "wait_s", "ttft_p50_s", "ttft_p90_s")  # [min-max] beside a median of repeated runs
PAIRED_KEYS = ("wall_s", "wait_s")  # kept run by run (``by_run``) for the speedups of each round


def median_of_runs(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per configuration (in order of first appearance) from repeated runs of it: every scalar figure
    is the median over its runs (counts stay whole numbers), the per-turn lists and per-kind tables are those of
    the run whose wall time is the median (the lower middle one of an even count), ``runs`` is how many ran and
    ``spread`` gives min and max of the headline figures, ``by_run`` the wall and wait times run by run, in order.
    A configuration that ran once is returned as it is, with ``runs`` 1."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        groups[s["config"]].append(s)
    out = []
    for runs in groups.values():
        if len(runs) == 1:
            out.append({**runs[0], "runs": runs[0].get("runs", 1)})
            continue
        if any(s.get("runs", 1) > 1 for s in runs):
            raise ValueError(f"{runs[0]['config']}: a median of repeated runs cannot be joined with other runs "
                             "(join the partial.jsonl files, one line a run)")
        by_wall = sorted(runs, key=lambda s: s["wall_s"])
        merged = dict(by_wall[(len(by_wall) - 1) // 2])
        for key, value in list(merged.items()):
            values = [s[key] for s in runs if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or len(values) != len(runs):
                continue
            middle = statistics.median(values)
            merged[key] = round(middle) if all(isinstance(v, int) for v in values) else middle
        merged["runs"] = len(runs)
        merged["spread"] = {k: [min(s[k] for s in runs), max(s[k] for s in runs)]
                            for k in SPREAD_KEYS if all(k in s for s in runs)}
        merged["by_run"] = {k: [s[k] for s in runs] for k in PAIRED_KEYS if all(s.get(k) for s in runs)}
        out.append(merged)
    return out


def _by_round(base: dict[str, Any], s: dict[str, Any], key: str) -> list[float] | None:
    """Baseline / this configuration for each round, when both ran the same number of rounds (the i-th run of
    each is round i: ``--repeats`` alternates the configurations, and joined files keep their order)."""
    a, b = base.get("by_run", {}).get(key), s.get("by_run", {}).get(key)
    if not a or not b or len(a) != len(b):
        return None
    return [round(x / y, 3) for x, y in zip(a, b)]


def with_speedups(summaries: list[dict[str, Any]], baseline: str | None = None) -> list[dict[str, Any]]:
    """Adds ``speedup`` (baseline wall time / this one), ``wait_speedup`` (the same for the time a session
    waits for the server, think time excluded) and ``prefill_reduction``; the baseline is the named
    configuration, else the first. Of repeated runs these are ratios of medians; where the baseline ran as many
    rounds, ``speedup_by_round`` / ``wait_speedup_by_round`` hold each round's ratio and ``spread`` their range."""
    if not summaries:
        return summaries
    base = next((s for s in summaries if s["config"] == baseline), summaries[0])
    for s in summaries:
        s["speedup_vs"] = base["config"]
        s["speedup"] = round(base["wall_s"] / s["wall_s"], 3) if s["wall_s"] else None
        s["wait_speedup"] = round(base["wait_s"] / s["wait_s"], 3) if s.get("wait_s") else None
        s["prefill_reduction"] = (round(base["prefilled_tokens"] / s["prefilled_tokens"], 3)
                                  if s["prefilled_tokens"] else None)
        for key, name in (("wall_s", "speedup"), ("wait_s", "wait_speedup")):
            rounds = _by_round(base, s, key) if s is not base else None
            if rounds:  # the spread of the paired ratios beside the ratio of the medians
                s[f"{name}_by_round"] = rounds
                s.setdefault("spread", {})[name] = [min(rounds), max(rounds)]
    return summaries


COLUMNS = [("config", "config", "{}"), ("runs", "runs", "{}"), ("wall_s", "wall s", "{:.2f}"),
           ("speedup", "speedup", "{:.2f}x"), ("wait_s", "wait s", "{:.2f}"),
           ("wait_speedup", "wait speedup", "{:.2f}x"),
           ("ttft_p50_s", "ttft p50 ms", "{:.1f}"), ("ttft_p90_s", "ttft p90 ms", "{:.1f}"),
           ("prefilled_tokens", "prefilled", "{}"), ("prefix_cached_tokens", "prefix hit", "{}"),
           ("resumed_tokens", "resumed", "{}"), ("generated_tokens", "generated", "{}"),
           ("peak_kv_pages", "peak pages", "{}")]


def steps_table(summaries: list[dict[str, Any]]) -> str:
    """Engine steps per kind: count and wall seconds, per configuration; then the seconds of chain tier moves
    (summaries made before those were counted show none)."""
    head = ["config"] + [f"{k} (n / s)" for k in STEP_KINDS] + [f"{m} s" for m in TIER_MOVES]
    rows = [head] + [[s["config"]] + [f"{s['engine_steps'][k]} / {s['engine_step_seconds'][k]:.1f}"
                                      for k in STEP_KINDS]
                     + [f"{s['tier_seconds'][m]:.2f}" if "tier_seconds" in s else "-" for m in TIER_MOVES]
                     for s in summaries if "engine_steps" in s]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def table(summaries: list[dict[str, Any]]) -> str:
    """The headline figures, a configuration a row; a figure of repeated runs is their median with [min-max]."""
    def cell(s: dict[str, Any], key: str, fmt: str) -> str:
        value = s.get(key)
        if value is None:
            return "-"
        scale = 1000 if key.startswith("ttft") else 1
        text = fmt.format(value * scale)
        if key in s.get("spread", {}):
            lo, hi = s["spread"][key]
            text += f" [{fmt.format(lo * scale)}-{fmt.format(hi * scale)}]"
        return text

    rows = [[title for _, title, _ in COLUMNS]] + [[cell(s, k, f) for k, _, f in COLUMNS] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
