"""One untimed prefill before an engine takes requests, so that no user's first request pays the kernels' first
compilations and autotuning.

On a GPU the first prompt chunk of each shape compiles Triton kernels (the engine's and fla-core's, whose
autotuning then keeps the launch it chose for every later length, so the chunk it measures on should be a full
one) and plans flashinfer's, which a server would otherwise charge to the first request it serves. ``warm_up``
runs one request of a full step's tokens (``max_num_batched_tokens``, less where the context is shorter; none
where the pool cannot hold them) with the engine's default method and one output token, and then leaves the
engine as it found it: every page free, nothing published to the prefix cache, no request id taken. Decode
kernels are compiled by the decode graphs' capture before it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

REQUEST_ID = "engine-warm-up"


def warmup_prompt(engine: LLMEngine) -> list[int]:
    """A full step's tokens of a fixed sequence over the vocabulary (no special meaning: only its length matters)."""
    n = min(engine.config.max_num_batched_tokens, engine.max_model_len - 1)
    vocab = engine.model_config.vocab_size
    return [(7 + 31 * i) % vocab for i in range(n)]


def warm_up(engine: LLMEngine) -> int:
    """Run the warm-up request to its end; returns the prompt tokens it prefilled (0 when none fits the pool)."""
    prompt = warmup_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    try:
        engine.add_request(prompt, params, request_id=REQUEST_ID)
    except InvalidRequestError as e:  # a pool smaller than one full step: nothing to warm up with
        log.info("no warm-up prefill: %s", e)
        return 0
    while engine.has_unfinished():
        engine.step()
    engine.clear_prefix_cache()
    engine.last_step = None
    log.info("warm-up: one prefill of %d tokens in %.1f s (kernels compiled before the first request)",
             len(prompt), time.perf_counter() - t)
    return len(prompt)
