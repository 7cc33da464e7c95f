"""How long the last engine step's phases took, and what kind of step it was.

``LLMEngine.last_step`` holds one ``StepTiming``; the server's per-kind step counters and the benchmarks read
it, so its fields are measured the same way by the plain step and the decode-window path.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import StepPlan


@dataclass(slots=True)
class StepTiming:
    """Wall time of the last step's phases, in seconds (execute includes the device work it waits on)."""

    num_requests: int
    num_tokens: int
    schedule_s: float
    prepare_s: float
    execute_s: float
    update_s: float
    decode_steps: int = 1  # decode steps this step() ran back to back (EngineConfig.decode_steps)
    prefill_tokens: int = 0  # of num_tokens, those of prompts (the rest decode)
    replayed: bool = False  # the forward replayed decode CUDA graphs
    overlapped: bool = False  # the next window was launched before this one's tokens were read (overlap_decode)

    @property
    def kind(self) -> str:
        """decode-graph | decode-eager | mixed (prompt chunks and decodes) | prefill."""
        if self.prefill_tokens == 0:
            return "decode-graph" if self.replayed else "decode-eager"
        return "prefill" if self.prefill_tokens == self.num_tokens else "mixed"


def prefill_tokens(plan: StepPlan) -> int:
    """Prompt tokens among the plan's scheduled tokens (before ``Scheduler.update`` advances the counts)."""
    return sum(max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
               for req, n in zip(plan.requests, plan.num_new_tokens))
