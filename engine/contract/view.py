"""Attention views: what an attention backend reads for one layer of one step.

A view describes *which* KV a layer's queries attend to; the cache manager owns the storage it points into.
Queries of all requests are flattened into one [T, Hq, D] tensor; request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]`` and attends to the first ``kv_lens[i]`` physical slots named by
``block_tables[i]``. The new tokens are the last ``query_len`` of those slots, so causal masking is
"query j sees slots < kv_len - query_len + j + 1".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass(slots=True)
class PagedView:
    """Dense paged KV: every resident slot of each request.

    block_tables: [B, max_pages] int32 page ids (padding entries are 0 and never read).
    kv_lens: [B] int32 physical KV length per request, new tokens included.
    query_start_loc: [B + 1] int32 CSR offsets into the flattened queries.
    Host copies (``*_cpu`` lists) let the torch backend loop without device syncs.
    """

    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    page_size: int
    kv_lens_cpu: list[int]
    query_lens_cpu: list[int]
    causal: bool = True

    # A backend that reads the parent view type reads this one correctly (see ``backend_can_read``). False for
    # views whose ``block_tables``/``kv_lens`` alone do not describe what attention reads.
    parent_readable: ClassVar[bool] = True
    # fields with one entry per request (sliced by ``rows``); every other field is shared by all requests
    per_request: ClassVar[tuple[str, ...]] = ("block_tables", "kv_lens", "kv_lens_cpu", "query_lens_cpu")

    def rows(self, start: int, stop: int, first_query_row: int) -> PagedView:
        """The view of requests ``start:stop`` alone, whose queries begin at row ``first_query_row``."""
        sliced = {f: getattr(self, f)[start:stop] for f in self.per_request if getattr(self, f) is not None}
        qsl = self.query_start_loc[start:stop + 1] - first_query_row
        return dataclasses.replace(self, query_start_loc=qsl, **sliced)

    @property
    def num_requests(self) -> int:
        return len(self.kv_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class SelectedPagesView(PagedView):
    """Logical selection: attention reads only the listed pages (a subset of what is resident).

    ``block_tables``/``kv_lens`` here name the selected pages and the number of selected slots; the last
    page of each request is always included so the new tokens stay visible.
    """


@dataclass(slots=True)
class SelectedSlotsView(PagedView):
    """Token-granularity selection: attention reads exactly the listed slots of each request.

    slot_indptr: [B + 1] int64 offsets into ``slot_indices``.
    slot_indices: [nnz] int64 flat physical slots (``page * page_size + offset``) of request ``i`` at
    ``slot_indptr[i]:slot_indptr[i] + n_i``, in increasing logical order, so the request's new tokens are
    its last ``query_len`` entries and causal masking runs over list order: query ``j`` sees the first
    ``n_i - query_len + j + 1`` listed slots. Entries past ``n_i`` up to ``slot_indptr[i + 1]`` are padding
    (a method that lists a fixed number per request on the device).
    slot_table: optional [B, W >= max n_i] int32, row ``i`` = request ``i``'s listed slots padded with 0: the
    same lists as a page table of one-slot pages, built on the device by the method (a GPU backend reads it
    without knowing the counts on the host; without it, backends build it from the lists).

    ``kv_lens``/``kv_lens_cpu`` hold the number of listed slots per request (``n_i``); ``block_tables`` still
    names the request's resident pages (what the slots point into). A backend must accept this view type
    explicitly: reading it as a plain ``PagedView`` would attend to the wrong slots.
    """

    slot_indptr: torch.Tensor = field(kw_only=True)
    slot_indices: torch.Tensor = field(kw_only=True)
    slot_table: torch.Tensor | None = field(kw_only=True, default=None)

    parent_readable: ClassVar[bool] = False


def backend_can_read(view_type: type, accepted: tuple[type, ...]) -> bool:
    """Whether a backend accepting ``accepted`` view types reads ``view_type``: it must subclass an accepted
    type, and every class on the way down from that type must be readable as its parent."""
    for base in accepted:
        if not issubclass(view_type, base):
            continue
        chain = [c for c in view_type.__mro__ if isinstance(c, type) and issubclass(c, base) and c is not base]
        if all(c.__dict__.get("parent_readable", True) for c in chain):
            return True
    return False


@dataclass(slots=True)
class QuantizedPagesView(PagedView):
    """Dense paged KV stored by a codec (``engine.contract.codec``), for one layer.

    ``k_fields``/``v_fields``: the codec's side tensors of this layer, each ``[num_pages, page_size // g,
    Hkv, width]``. Request ``i``'s first ``quant_lens[i]`` slots are read from them; its slots
    ``quant_lens[i]:kv_lens[i]`` from the full-precision ring ``window_k/v[window_ids[i]]`` ([num_windows,
    capacity, Hkv, D]) at ``slot % capacity`` (``window_k`` is None for codecs without a window).
    """

    codec: object = field(kw_only=True)
    layer: int = field(kw_only=True, default=0)  # the layer the fields belong to (``codec.layer_codec``)
    k_fields: dict[str, torch.Tensor] = field(kw_only=True)
    v_fields: dict[str, torch.Tensor] = field(kw_only=True)
    quant_lens: torch.Tensor = field(kw_only=True)
    quant_lens_cpu: list[int] = field(kw_only=True)
    window_ids: torch.Tensor | None = field(kw_only=True, default=None)
    window_ids_cpu: list[int] | None = field(kw_only=True, default=None)
    window_k: torch.Tensor | None = field(kw_only=True, default=None)
    window_v: torch.Tensor | None = field(kw_only=True, default=None)

    parent_readable: ClassVar[bool] = False
    per_request: ClassVar[tuple[str, ...]] = PagedView.per_request + (
        "quant_lens", "quant_lens_cpu", "window_ids", "window_ids_cpu")


@dataclass(slots=True)
class QuantizedLatentView(QuantizedPagesView):
    """A latent (MLA) cache stored by a codec, for one layer: one KV head whose row of each slot is coded once
    by ``row_codec`` (a ``TensorCodec``; its fields are ``k_fields``, and ``v_fields`` is the same dict), keys the
    decoded rows and values their first ``value_dim`` channels. Every slot is read from codes (no window).

    Not readable as a ``QuantizedPagesView``: a backend's per-head codec kernels would read values as wide as
    the keys and decode them with the codec's per-head format."""

    row_codec: object = field(kw_only=True)
    value_dim: int = field(kw_only=True)

    parent_readable: ClassVar[bool] = False
