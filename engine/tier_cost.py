"""Load a chain from disk or recompute it: the cost rule, and the two rates it reads, measured as the engine runs.

A turn whose chain is in the disk tier can read the chain's file back, or drop it and prefill the chain's whole
history again. Which is faster depends on the machine: a slow disk can take several times longer to read a long
chain's KV than the GPU takes to recompute it (docs/benchmarks.md, chain resume at 32K), NVMe reads it faster,
and a compacted chain has fewer bytes to read but the same history to recompute. So nothing here is
configured: the disk tier measures its read rate from its own completed file loads (bytes per second), the
scheduler its prefill rate (prompt tokens per second of the steps that ran them), and a turn recomputes only when
both are known and the estimated read is slower than the estimated recompute by more than ``MARGIN``. Before any measurement exists it loads, which measures the disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 1.5  # the estimated read must exceed the estimated recompute this many times over to recompute
READ_DECAY = 0.5  # the weight of earlier file loads after each new one (the last few loads count)
PREFILL_DECAY = 0.9  # the weight of earlier steps after each new one (steps are many and small)


def recompute_instead(file_bytes: int, history_tokens: int, read_rate: float | None, prefill_rate: float | None,
                      margin: float = MARGIN) -> bool:
    """Whether to drop a chain's file and recompute its ``history_tokens`` rather than read its ``file_bytes``:
    ``file_bytes / read_rate > margin * history_tokens / prefill_rate``. An unknown rate (None or not > 0) loads:
    nothing says reading is slower, and a load measures it."""
    if not (read_rate and read_rate > 0 and prefill_rate and prefill_rate > 0):
        return False
    return read_seconds(file_bytes, read_rate) > margin * recompute_seconds(history_tokens, prefill_rate)


def read_seconds(file_bytes: int, read_rate: float) -> float:
    return file_bytes / read_rate


def recompute_seconds(history_tokens: int, prefill_rate: float) -> float:
    return history_tokens / prefill_rate


@dataclass(slots=True)
class Rate:
    """A rate from observations of (amount, seconds): decayed sums of both, their ratio the rate. Each new
    observation multiplies the sums before it by ``decay``, so the rate follows the latest ones, and a large
    observation weighs more than a small one whose fixed costs dominate its seconds."""

    decay: float
    amount: float = 0.0
    seconds: float = 0.0

    def observe(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self.amount = self.decay * self.amount + amount
            self.seconds = self.decay * self.seconds + seconds

    @property
    def per_second(self) -> float | None:
        """The rate; None before any observation."""
        return self.amount / self.seconds if self.seconds > 0 else None


@dataclass(slots=True)
class TierRates:
    """What the rule reads: the disk tier's file read rate (bytes per second: reading and checking a file into
    host memory) and the engine's prefill rate (prompt tokens per second of the steps that ran them)."""

    disk_read: Rate = field(default_factory=lambda: Rate(READ_DECAY))
    prefill: Rate = field(default_factory=lambda: Rate(PREFILL_DECAY))

    def recompute_instead(self, file_bytes: int, history_tokens: int) -> bool:
        return recompute_instead(file_bytes, history_tokens, self.disk_read.per_second, self.prefill.per_second)
