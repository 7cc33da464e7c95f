"""EngineHandle: the part of the engine the server drives, as a structural type.

The server (agentrt) holds its engine as an ``EngineHandle`` and touches nothing else of it, so what the server
depends on is written down in one place and an engine change that breaks it shows up as a type error, not as a
missing attribute at run time. ``LLMEngine`` satisfies it structurally (it does not name it); the test
tests/engine/test_engine_handle.py keeps the two in step.

The methods run on the engine's worker thread (agentrt.engine_worker), or before that thread starts, and so do
reads of ``pool`` and ``last_step``; the other attributes are fixed when the engine is built, and the event loop
reads them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: naming the engine's types must not load the model stack (engine.llm_engine)
    from engine.chain_index import ChainInfo
    from engine.chain_prune import PruneResult
    from engine.config import EngineConfig
    from engine.contract.method import SparseMethod
    from engine.llm_engine import StepTiming
    from engine.model_config import ModelConfig
    from engine.outputs import RequestOutput
    from engine.page_pool import PagePool
    from engine.sampling_params import SamplingParams


@runtime_checkable
class EngineHandle(Protocol):
    # --- attributes (read-only) -----------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """``model`` names the checkpoint directory; ``method_config`` is the default method's configuration."""
        ...

    @property
    def model_config(self) -> ModelConfig:
        """``vocab_size`` bounds forced token ids; ``eos_token_ids`` end generation."""
        ...

    @property
    def method(self) -> SparseMethod:
        """The engine's default sparse method (its ``name`` is what a chain runs when it names none)."""
        ...

    @property
    def max_model_len(self) -> int:
        ...

    @property
    def pool(self) -> PagePool:
        """The KV page pool (``num_pages``, ``num_free``) behind the server's page gauges."""
        ...

    @property
    def last_step(self) -> StepTiming | None:
        """The timing of the last ``step`` (None when it ran nothing)."""
        ...

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, chain_id: str | None = None, method: str | None = None,
                    method_config: dict | None = None) -> str:
        """Queue a request and return its id; raises engine.errors.InvalidRequestError for one the engine
        refuses (ChainBusyError: its chain has a turn in flight), ConfigError for a method it cannot serve."""
        ...

    def step(self) -> list[RequestOutput]:
        ...

    def abort(self, request_id: str) -> RequestOutput | None:
        """None when the engine no longer holds the request."""
        ...

    def has_unfinished(self) -> bool:
        ...

    # --- method configurations ----------------------------------------------------------------
    def retain_method(self, method: str | None, method_config: dict | None = None) -> str:
        """Take the configuration on (ConfigError when the engine cannot serve it) and hold one of its slots
        until ``release_method``. Returns the method's name."""
        ...

    def release_method(self, method: str | None, method_config: dict | None = None) -> None:
        ...

    # --- chains: UnknownChainError for a chain the engine does not hold, ChainBusyError for a busy one ----
    def chain_info(self, chain_id: str) -> ChainInfo:
        ...

    def delete_chain(self, chain_id: str) -> None:
        ...

    def fork_chain(self, chain_id: str, new_chain_id: str) -> None:
        ...

    def rewind_chain(self, chain_id: str, num_tokens: int) -> None:
        ...

    def pin_chain(self, chain_id: str, pinned: bool = True) -> None:
        ...

    def chain_hints(self, chain_id: str, *, priority: int | None = None, ttl_s: float | None = None,
                    clear_ttl: bool = False) -> None:
        ...

    def release_chain(self, chain_id: str) -> bool:
        ...

    def prefetch_chain(self, chain_id: str) -> bool:
        ...

    def adopt_chain(self, path: str) -> bool:
        """Take over a chain file another engine wrote (agentrt.scaleout hands a drained replica's chains off)."""
        ...

    def prune_chain(self, chain_id: str, intervals: list[tuple[int, int]], scorer: str | None = None,
                    keep_ratio: float = 0.0, defer: bool = True, keep_tokens: int | None = None) -> PruneResult:
        ...
