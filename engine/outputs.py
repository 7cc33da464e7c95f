"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine.chain_index loads the KV cache (torch): this module stays light
    from engine.chain_index import ResumeStatus


@dataclass(slots=True)
class RequestOutput:
    """State of one request after a step. ``new_token_ids``/``new_text`` are this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[float] | None = None
    stop_reason: str | int | None = None
    chain_id: str | None = None
    resume_status: ResumeStatus | None = None  # set for a chain turn
    num_prefilled_tokens: int = 0
    num_resumed_tokens: int = 0
    # per generated token, its K most likely alternatives as (token_id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
