"""Hybrid models' KV: dense pages for the full-attention layers plus a fixed-size recurrent state per running
request for every linear-attention layer (a gated DeltaNet's causal-conv inputs and its recurrent matrix).

The spec counts only the full-attention layers as ``num_layers`` (pages, views, methods and compaction see
those alone); the states live in slots ``[linear_layers, max_states + 1, ...]`` whose bytes come out of the KV
budget first, like a codec's windows (``window_bytes``). A running table holds a slot (``open_table``, the
table's ``window``): a table that has computed nothing starts from zeros; a table coming back (a chain's next
turn) copies in the state it saved when it stopped (``close_table`` keeps a copy on the table in host memory, pinned
on a GPU: an idle chain's state costs no device memory and no pages). On a GPU that copy runs on a side stream after
the step's queued work, so a turn's end never makes the host wait for the device: the saved state carries the copy's
event (``SavedState.done``), which host readers wait for (``SavedState.wait``) and copies back to the device are
queued after; the slot it was copied from is not written again before the copy has read it (``open_table`` queues the
step stream's wait for that event). A state exists only at its table's end, so a table cannot be cut back
(``cuts_tables`` is False: a rewound or diverging chain is recomputed). For prefix caching the storage keeps
checkpoints: with ``prefix_checkpoints`` > 0 a prefill chunk that does not end its prompt ends on a page boundary
(``aligned_prefill``), the state there is copied to host memory under the prefix-cache key of the page that ends there
(``checkpoint``; least recently used dropped beyond ``prefix_checkpoints``), and a new request whose prefix matches
published pages starts from the last matched page that has a checkpoint, with that state (``resumable_prefix``). With
none the spec is not ``prefix_reusable`` and prefix caching is off.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.contract.cache import CacheSpec
from engine.contract.storage import TableHandle
from engine.errors import EngineError
from engine.kv_memory import zeroed
from engine.side_stream import SideStream
from engine.storage.dense import DenseKV


@dataclass(slots=True, frozen=True)
class HybridCacheSpec(CacheSpec):
    """``num_layers`` full-attention layers of dense KV, plus per running request and linear layer a conv state
    ``conv_shape`` (model dtype) and a recurrent state ``recurrent_shape`` (``state_dtype``)."""

    linear_layers: int = 0
    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    state_dtype: torch.dtype = torch.float32
    max_states: int = 0  # running requests that hold a state slot at once
    prefix_checkpoints: int = 0  # states kept at page boundaries for prefix reuse (host memory)

    @property
    def state_bytes(self) -> int:
        """One request's state over every linear layer."""
        conv = self.dtype.itemsize * _prod(self.conv_shape)
        recurrent = self.state_dtype.itemsize * _prod(self.recurrent_shape)
        return self.linear_layers * (conv + recurrent)

    @property
    def window_bytes(self) -> int:
        return (self.max_states + 1) * self.state_bytes

    @property
    def prefix_reusable(self) -> bool:
        return self.prefix_checkpoints > 0

    @property
    def recurrent_layers(self) -> int:
        return self.linear_layers


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class LinearState:
    """What a linear-attention layer reads and writes in one step (``LayerRunner.linear_state``): the layer's slot
    buffers and, in batch order, each request's slot in them; the layer reads a request's states at its slot and
    writes the states after the step over them."""

    def __init__(self, storage: HybridKV, layer: int, slots: torch.Tensor, query_lens: list[int]):
        self.layer, self.slots, self.query_lens = layer, slots, query_lens
        self.conv_buffer = storage.conv[layer]  # [slots, conv_dim, kernel - 1]
        self.recurrent_buffer = storage.recurrent[layer]  # [slots, heads, k_dim, v_dim]


@dataclass(slots=True)
class SavedState:
    """A stopped table's states (every linear layer), kept with the table until it runs again. ``done``: the CUDA
    event recorded after the copies into these host tensors while they may still be running (None: complete);
    read the tensors on the host only after ``wait``."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    done: Any = None

    def wait(self) -> None:
        """Block until the copies into the tensors are complete."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of a slot's state (pinned when it comes from a GPU, so the copy back runs at full speed); on a
    GPU queued without waiting for it (the caller records its event after)."""
    if x.device.type == "cpu":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host


def _host_clone(x: torch.Tensor) -> torch.Tensor:
    """A second host copy (pinned where ``x`` is)."""
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_pinned()).copy_(x)


class HybridKV(DenseKV):
    cuts_tables = False

    def __init__(self, spec: HybridCacheSpec, num_pages: int):
        super().__init__(spec, num_pages)
        slots = spec.max_states + 1  # the last one is scratch (padding rows)
        self.conv = zeroed((spec.linear_layers, slots, *spec.conv_shape), spec.dtype, spec.device)
        self.recurrent = zeroed((spec.linear_layers, slots, *spec.recurrent_shape), spec.state_dtype, spec.device)
        self._free = list(range(spec.max_states - 1, -1, -1))
        # the batch's state slots as a device tensor, made once per step (every linear layer asks for the same)
        self._slots: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.checkpoints: OrderedDict[Any, SavedState] = OrderedDict()  # prefix key -> state there, LRU first
        self._side = SideStream()
        self._copying: dict[int, Any] = {}  # slot -> the event after a side-stream copy that reads it

    @property
    def free_states(self) -> int:
        return len(self._free)

    def open_table(self, table: TableHandle) -> bool:
        if table.window is not None:
            return True
        if not self._free:
            return False
        slot = self._free.pop()
        read = self._copying.pop(slot, None)
        if read is not None:  # what the step stream writes into the slot next must wait for that copy
            torch.cuda.current_stream(self.conv.device).wait_event(read)
        saved = table.state
        if saved is not None:
            if saved.done is not None:
                torch.cuda.current_stream(self.conv.device).wait_event(saved.done)
            self.conv[:, slot].copy_(saved.conv, non_blocking=True)
            self.recurrent[:, slot].copy_(saved.recurrent, non_blocking=True)
            table.state = None
        elif table.num_slots == 0:
            self.conv[:, slot] = 0
            self.recurrent[:, slot] = 0
        else:
            self._free.append(slot)
            raise EngineError("a table with computed tokens and no recurrent state cannot run (prefix reuse or a "
                              "cut table on a hybrid model)")
        table.window = slot
        return True

    def close_table(self, table: TableHandle) -> None:
        if table.window is None:
            return
        slot, table.window = table.window, None
        if table.num_slots:
            table.state = self._save(slot)
        self._free.append(slot)

    def _save(self, slot: int) -> SavedState:
        """The slot's states copied to host memory: on a GPU on the side stream after the step's queued work (the
        host does not wait; the slot is marked as read until the copy's event)."""
        if self.conv.device.type != "cuda":
            return SavedState(_to_host(self.conv[:, slot]), _to_host(self.recurrent[:, slot]))
        (conv, recurrent), done = self._side.run(
            self.conv.device, lambda: (_to_host(self.conv[:, slot]), _to_host(self.recurrent[:, slot])))
        self._copying[slot] = done
        return SavedState(conv, recurrent, done)

    def drop_table_state(self, table: TableHandle) -> None:
        """The table's pages go back to the pool: its state goes with them, its slot freed without a host copy
        (``close_table``'s copy is for a table that runs again; a finished request would pay it for nothing)."""
        if table.window is not None:
            self._free.append(table.window)
            table.window = None
        table.state = None

    def fork_table_state(self, src: TableHandle, dst: TableHandle) -> None:
        saved = src.state
        if saved is not None:
            saved.wait()
            dst.state = SavedState(_host_clone(saved.conv), _host_clone(saved.recurrent))

    @property
    def aligned_prefill(self) -> bool:
        return self.spec.prefix_checkpoints > 0

    def checkpoint(self, table: TableHandle, key: Any) -> None:
        if self.spec.prefix_checkpoints <= 0 or table.window is None:
            return
        slot, device = table.window, self.conv.device
        saved = SavedState(_to_host(self.conv[:, slot]), _to_host(self.recurrent[:, slot]))
        if device.type == "cuda":  # queued on the step's stream, before the next chunk's writes to the slot
            saved.done = torch.cuda.Event()
            saved.done.record(torch.cuda.current_stream(device))
        self.checkpoints[key] = saved
        self.checkpoints.move_to_end(key)
        while len(self.checkpoints) > self.spec.prefix_checkpoints:
            self.checkpoints.popitem(last=False)

    def resumable_prefix(self, keys: list[Any]) -> tuple[int, Any]:
        for n in range(len(keys), 0, -1):
            saved = self.checkpoints.get(keys[n - 1])
            if saved is not None:
                self.checkpoints.move_to_end(keys[n - 1])
                return n, SavedState(saved.conv, saved.recurrent, saved.done)  # ``open_table`` copies it into a slot
        return 0, None

    def linear_state(self, tables: list[TableHandle], layer: int, query_lens: list[int]) -> LinearState:
        return LinearState(self, layer, self.state_slots(tables), query_lens)

    def state_slots(self, tables: list[TableHandle]) -> torch.Tensor:
        """The tables' state slots, in order, as a device tensor (made once per step: every linear layer asks)."""
        key = tuple(t.window for t in tables)
        if self._slots is None or self._slots[0] != key:
            self._slots = key, torch.tensor(key, dtype=torch.int64, device=self.conv.device)
        return self._slots[1]

    @property
    def scratch_state(self) -> int:
        """The slot padding rows of a decode graph read and write (no table owns it)."""
        return self.spec.max_states

    def linear_state_at(self, slots: torch.Tensor, layer: int, query_lens: list[int]) -> LinearState:
        """The state of rows whose slots a device tensor holds (a decode graph's static buffer)."""
        return LinearState(self, layer, slots, query_lens)
