"""LLM: offline batch generation on top of LLMEngine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """``LLM(model_dir, **engine_options).generate(prompts, params)``.

    >>> llm = LLM(embedded_model_dir(), max_num_batched_tokens=256)   # doctest: +SKIP
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].text  # doctest: +SKIP
    """

    def __init__(self, model: str | Path, **options: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op at tensor_parallel_size 1)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        methods: tuple[str, dict] | list[tuple[str, dict] | None] | None = None,
    ) -> list[RequestOutput]:
        """``methods``: one (name, config) for every prompt or a list, one per prompt (None: the engine's),
        so prompts of several sparse methods share the batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        per_method = methods if isinstance(methods, list) else [methods] * len(prompts)
        if len(per_method) != len(prompts):
            raise ValueError(f"got {len(per_method)} methods for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, m in zip(prompts, per_prompt, per_method):
                name, config = m if m is not None else (None, None)
                ids.append(self.engine.add_request(prompt, p, method=name, method_config=config))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while len(final) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError("engine went idle with requests unfinished")  # an engine bug
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[rid] for rid in ids]
