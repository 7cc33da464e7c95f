"""A request as the scheduler and runner see it.

``num_computed_tokens`` is the request's *logical* length: how many of its tokens have had their KV
computed. Physical lengths (slots actually held) belong to the cache manager.
"""

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine.chain_index imports this module (through engine.paged_cache)
    from engine.chain_index import ResumeStatus


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # aligned with the above
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    chain_id: str | None = None
    resume_status: "ResumeStatus | None" = None  # for chain turns
    num_resumed_tokens: int = 0  # tokens whose KV came from the chain
    parked: bool = False  # a queued chain turn whose chain KV moved to a tier under pressure (ChainMemory.park)
    num_prefilled_tokens: int = 0  # prompt tokens this request computed (recomputation after preemption too)
    method: Any = None  # the SparseMethod serving it (engine.method_set); set by the engine
    prefix_namespace: bytes | None = None  # its method's prefix-cache key space (None: the engine's method)
    max_prefix_reuse: int | None = None  # the most prompt tokens it may take from the prefix cache
    grammar: Any = None  # its structured-output matcher (engine.structured_output), with params.structured

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def forced_next_token(self, ahead: int = 0) -> int | None:
        """The forced token of the output ``ahead`` tokens after the next one (None: sample it)."""
        forced = self.params.forced_token_ids
        n = self.num_output_tokens + ahead
        return forced[n] if n < len(forced) else None

    def append_output(self, token_id: int, logprob: float | None,
                      top_logprobs: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def stop_by_token(self, token_id: int) -> bool:
        if token_id in self.params.stop_token_ids:
            return True
        return not self.params.ignore_eos and token_id in self.eos_token_ids

    def reached_length_limit(self) -> bool:
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len
