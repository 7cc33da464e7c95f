"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParamsError
from engine.structured_output import StructuredSpec

_GREEDY_EPS = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False
    forced_token_ids: list[int] = field(default_factory=list)  # emitted first, in order (replays, tests)
    top_logprobs: int = 0  # with logprobs: also the K most likely tokens of each step, K <= MAX_TOP_LOGPROBS
    structured: StructuredSpec | None = None  # the output must match this grammar (engine.structured_output)
    # False: special tokens stay in the text (a chat format whose tool-call or think tags are special tokens),
    # except a stop token that ends the request
    skip_special_tokens: bool = True
    # max_tokens is a ceiling: the engine lowers it to what the model's context and the KV pool can hold for the
    # prompt (the request ends with finish_reason "length" there) instead of refusing the request
    fit_max_tokens: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p"):
            if not _is_real(getattr(self, name)):
                raise bad(name, "must be a number")
            setattr(self, name, float(getattr(self, name)))
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")

        for name in ("top_k", "max_tokens"):
            if not _is_int(getattr(self, name)):
                raise bad(name, "must be an int")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive int")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if isinstance(self.forced_token_ids, tuple):
            self.forced_token_ids = list(self.forced_token_ids)
        if not isinstance(self.forced_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.forced_token_ids
        ):
            raise bad("forced_token_ids", "must be a list of non-negative ints")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise bad("seed", "must be an int in [0, 2**63) or None")

        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", "must be a list of ints")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only non-negative ints")
        self.stop_token_ids = list(self.stop_token_ids)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise bad("stop", "must be a str or a list of str")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must contain only non-empty strings")
        self.stop = list(self.stop)

        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "fit_max_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if not (_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("top_logprobs", f"must be an int in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "> 0 requires logprobs=True")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise bad("structured", "must be a StructuredSpec or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
