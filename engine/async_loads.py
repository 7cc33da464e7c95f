"""Loading a chain's KV back from the host tier on a side stream, so that other requests' steps run meanwhile.

Without it (``EngineConfig.chain_async_loads`` off, and always on a CPU), a turn whose chain is in the host tier
copies its pages in on the step's stream and the host waits for the copy (and for the device's queue before it).
With it, ``ChainTiers.load`` starts the copy on a side stream that first waits for the work already queued (a
fresh page may still be read or written by a step in flight) and returns the table with a ``PendingCopy``
(``PageTable.ready``); ``ChainManager`` keeps the turn parked while the copy runs, and when the scheduler reaches
it and the copy is done (or nothing else could run), the step's stream waits for the copy's event before anything
reads the pages (``settle``). Until then nothing else can touch them: the chain is busy (no reclaim, fork, rewind
or prune takes a busy chain) and the table is attached to no request; an aborted turn settles it before the chain
takes it back.

The host tensors copied from stay alive until the copy is done: the pinned ones through the caching host
allocator (it reuses a pinned block only after the copies recorded on it), pageable ones (read from a file) because
the driver stages pageable memory before the copy call returns.
"""

from __future__ import annotations

import torch

from engine.side_stream import SideStream, device_index


class PendingCopy:
    """A copy into a table's pages in flight on a side stream."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def settle(self) -> None:
        """Order the current stream's later work after the copy (the host does not wait)."""
        torch.cuda.current_stream().wait_event(self.event)


class SideStreamCopier:
    """Copies host tensors into page tensors on a side stream (``engine.side_stream``), after the steps in flight
    (they may still use the fresh pages)."""

    def __init__(self) -> None:
        self._side = SideStream()

    def copy_in(self, targets: list[tuple[torch.Tensor, int]], pages: list[int],
                sources: list[torch.Tensor]) -> PendingCopy:
        """``target.index_copy_(dim, pages, source)`` for each (target, dim) and source, on the side stream."""
        device = targets[0][0].device

        def copy() -> None:
            index = device_index(pages, device)
            for (target, dim), source in zip(targets, sources):
                target.index_copy_(dim, index, source.to(device, non_blocking=True))

        _, event = self._side.run(device, copy)
        return PendingCopy(event)
