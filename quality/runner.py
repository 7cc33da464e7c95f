"""Run samples through the real engine (greedy) and score exact answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from quality.tasks import Sample

DEFAULT_ENGINE_OPTIONS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "page_size": 16,
                                          "max_num_batched_tokens": 4096, "max_num_seqs": 16}


def make_engine(model_dir: str | Path, method: str = "dense", method_config: dict | None = None,
                **options: Any) -> LLMEngine:
    merged = {**DEFAULT_ENGINE_OPTIONS, **options}
    return LLMEngine(EngineConfig.from_kwargs(model_dir, method=method, method_config=method_config or {}, **merged))


def answer_params(sample: Sample) -> SamplingParams:
    """Greedy, long enough for the answer and its end token."""
    return SamplingParams(temperature=0.0, max_tokens=len(sample.answer_ids) + 1)


def is_correct(sample: Sample, token_ids: Iterable[int], end_ids: frozenset[int]) -> bool:
    """The model emitted exactly the answer tokens, then an end token (or ran out of tokens right after)."""
    ids = list(token_ids)
    n = len(sample.answer_ids)
    return ids[:n] == sample.answer_ids and (len(ids) == n or ids[n] in end_ids)


def run_samples(engine: LLMEngine, samples: list[Sample]) -> list[bool]:
    """All samples as one batch of independent requests; returns correctness in order."""
    ids = [engine.add_request(s.prompt_ids, answer_params(s)) for s in samples]
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    end_ids = frozenset(engine.model_config.eos_token_ids)
    return [is_correct(s, final[rid], end_ids) for s, rid in zip(samples, ids)]
