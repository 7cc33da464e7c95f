"""Replay synthetic agent traces against in-process servers, as a library (CPU, the embedded tiny model).

    python examples/replay.py

Two sessions of eight turns, replayed by a stateless OpenAI-style client on a server with a prefix cache,
then through chains (Chain Cache), then through chains with the lag pruning policy. The assistant emits the
recorded tokens in every run (forced decoding), so the runs do the same decode work.
"""

from __future__ import annotations

import json
import tempfile

from agentrt.replay.bench import run_all, standard_configs
from agentrt.replay.report import summarize, table, with_speedups
from agentrt.replay.synth import SynthShape, synth_traces
from agentrt.replay.trace import load, write_many
from engine.llm_engine import load_tokenizer
from engine.tiny_checkpoint import random_model_dir


def main() -> None:
    tokenizer = load_tokenizer(random_model_dir())
    tokenizer.model_max_length = 2**62
    shape = SynthShape(num_turns=(8, 8), system_tokens=400, tool_tokens=(50, 250), output_tokens=(56, 72))
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_many(synth_traces(tokenizer, 2, seed=0, shape=shape, vocab_size=len(tokenizer)), tmp)
        traces = [load(p) for p in paths]  # any JSONL trace in this format replays the same way
    configs = standard_configs()
    runs = run_all(traces, [configs[n] for n in ("dense-prefix", "dense-chain", "dense-chain-lag")],
                   engine_options={"device": "cpu", "num_pages": 2048}, think_scale=0.0)
    summaries = with_speedups([summarize(r) for r in runs], baseline="dense-prefix")
    print(json.dumps([{k: s[k] for k in ("config", "wall_s", "prefilled_tokens", "peak_kv_pages")} for s in summaries]))
    print(table(summaries))


if __name__ == "__main__":
    main()
