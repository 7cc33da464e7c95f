"""One CUDA side stream for copies that must follow the work already queued on the step's stream without making
the step wait: turn-end host copies (``engine.host_copies``) and asynchronous chain loads
(``engine.async_loads``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class SideStream:
    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None  # created on first use

    def run(self, device: torch.device, work: Callable[[], T]) -> tuple[T, torch.cuda.Event]:
        """``work()`` on the side stream after everything queued so far on ``device``'s current stream; returns its
        result and an event recorded after it. Tensors ``work`` makes are made on the side stream, so the
        allocator never hands their memory to the step's stream while the side stream still uses it."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            result = work()
            event = torch.cuda.Event()
            event.record(self._stream)
        return result, event


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, for work queued on a side stream: on a GPU copied from pinned
    memory, because a copy from pageable memory may make the host wait for the stream (CUDA's memcpy rules: the
    driver may synchronize with the stream to stage pageable memory), and the side stream waits for every step
    queued before it."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # the host allocator keeps it until the copy is done
