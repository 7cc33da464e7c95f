"""Probe forward: run the model over tokens that are not part of a request as queries against retained KV.

A probe asks "how much attention would these queries put on each slot the table holds?" without committing
anything: the probe tokens are placed at logical positions ``start, start + 1, ...`` (``start`` defaults to
the table's logical length, i.e. right after the history), attend to the table's retained slots whose logical
position is ``< start`` plus the probe's own earlier tokens (causal), and their KV lives only in per-layer
tensors dropped at the end; the page pool and the KV storage are never written. Long probes run in chunks of
``chunk_size`` queries (each chunk also attends to the earlier chunks' probe KV), so the attention matrix is
at most ``[num_heads, chunk_size, retained + probe]``.

Per layer the result is ``[num_kv_heads, physical_len(layer)]`` fp32: the softmax probability each probe
query put on each retained slot, reduced over the query heads that read that KV head and over the probe
queries, by ``max`` or ``mean``. Slots hidden from the probe (position >= ``start``) score 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.contract.view import PagedView
from engine.errors import ConfigError, InvalidRequestError
from engine.parallel.state import query_head_ranks, reduce_over_query_heads
from engine.request import Request

REDUCTIONS = ("max", "mean")


class _ProbeLayerRunner:
    """The model's LayerRunner for one probe (its chunks in order): attention over [visible retained KV + probe KV
    so far], accumulating the reduced probabilities on the retained slots.

    ``retained(layer)`` gives, per KV head, which of the layer's n retained slots the probe sees and either
    their keys and values ``[n, Hkv, D]`` or, where the layer's KV heads all see the same slots (``cols``,
    with a ``backend``), only those slots' keys and values; then the backend's ``forward_received`` computes
    the output and the reduction without a probability matrix (on a GPU: the prefill kernel with its
    log-sum-exp, then the received-attention kernel). Otherwise the chunk's full
    [Hkv, group, chunk, retained + probe] probabilities are formed in fp32 (the reference)."""

    wants_layer_output = False

    def __init__(self, retained: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                 scale: float, reduce: str, num_layers: int, backend: Any = None):
        self.retained = retained
        self.scale = scale
        self.reduce = reduce
        self.backend = backend
        self.past: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.scores: list[torch.Tensor | None] = [None] * num_layers
        self.num_reduced = [0] * num_layers  # (query head, probe query) pairs folded into a mean

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values, visible, cols = self.retained(layer)  # [Hkv, n] bool; keys/values [n, ..] or [cols, ..]
        past = self.past[layer]
        pk = k if past is None else torch.cat([past[0], k])
        pv = v if past is None else torch.cat([past[1], v])
        self.past[layer] = (pk, pv)
        if cols is None:
            out, part = self._dense(q, keys, values, visible, pk, pv)
        else:
            out, on_cols = self._received(q, keys, values, pk, pv)
            part = on_cols.new_zeros(visible.shape)
            part[:, cols] = on_cols
        part = reduce_over_query_heads(part, "max" if self.reduce == "max" else "sum")
        prev = self.scores[layer]
        if self.reduce == "max":
            self.scores[layer] = part if prev is None else torch.maximum(prev, part)
        else:
            self.scores[layer] = part if prev is None else prev + part
            self.num_reduced[layer] += q.shape[1] // visible.shape[0] * q.shape[0] * query_head_ranks()  # group x chunk
        return out

    def _received(self, q, keys, values, pk, pv) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's fused path: [visible retained + probe] as one request of pages of one slot."""
        c, n, device = q.shape[0], keys.shape[0], q.device
        all_k, all_v = torch.cat([keys, pk]).unsqueeze(1), torch.cat([values, pv]).unsqueeze(1)
        total = all_k.shape[0]
        view = PagedView(
            block_tables=torch.arange(total, dtype=torch.int32, device=device)[None],
            kv_lens=torch.tensor([total], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, c], dtype=torch.int32, device=device),
            page_size=1, kv_lens_cpu=[total], query_lens_cpu=[c], causal=True)
        out, (received,) = self.backend.forward_received(q, all_k, all_v, view, self.scale, keys.shape[1],
                                                         reduce="max" if self.reduce == "max" else "sum")
        return out, received[:, :n]

    def _dense(self, q, keys, values, visible, pk, pv) -> tuple[torch.Tensor, torch.Tensor]:
        c, hq, d = q.shape
        n, hkv = keys.shape[0], keys.shape[1]
        g = hq // hkv
        p = pk.shape[0] - c  # probe tokens of earlier chunks
        all_k = torch.cat([keys, pk]).float()
        all_v = torch.cat([values, pv]).float()
        logits = torch.einsum("ihgd,shd->hgis", q.float().reshape(c, hkv, g, d), all_k) * self.scale
        causal = torch.ones(c, p + c, dtype=torch.bool, device=q.device).tril(p)
        mask = torch.cat([visible[:, None, :].expand(hkv, c, n), causal.expand(hkv, c, p + c)], dim=2)
        probs = torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1)  # [Hkv, g, c, n + p + c]
        on_retained = probs[..., :n]
        part = on_retained.amax(dim=(1, 2)) if self.reduce == "max" else on_retained.sum(dim=(1, 2))
        out = torch.einsum("hgis,shd->ihgd", probs, all_v)
        return out.reshape(c, hq, all_v.shape[-1]).to(q.dtype), part

    def end_layer(self, layer: int, hidden: torch.Tensor) -> None:
        pass


class Prober:
    """Runs probe forwards for one engine (its model, cache manager and attention scale).

    ``encode(text) -> token ids`` is the engine's tokenizer (no special tokens), for probes given as text.
    ``backend``: the engine's attention backend, whose ``forward_received`` computes the probe's attention
    where every KV head of a layer sees the same slots, if it returns scores (``supports_scores``; None, or a
    backend that does not: always the fp32 full-matrix reference).
    """

    def __init__(self, model: torch.nn.Module, cache: Any, scale: float, encode: Callable[[str], list[int]],
                 backend: Any = None):
        self.model = model
        self.backend = backend if backend is not None and backend.supports_scores else None
        self.cache = cache
        self.scale = scale
        self.encode = encode
        self.max_positions = model.config.max_position_embeddings  # RoPE's table: probe positions stay below

    def run(self, table: Any, logical_len: int, token_ids: Sequence[int], *, start: int | None = None,
            reduce: str = "max", chunk_size: int = 512) -> list[torch.Tensor]:
        """Per layer ``[num_kv_heads, physical_len(layer)]`` fp32 reduced probabilities of ``token_ids`` as
        queries at logical positions ``start ..`` (default ``logical_len``) over ``table``'s retained slots.
        The table, its pages and the KV storage are left unchanged."""
        start = logical_len if start is None else start
        if self.cache.spec.recurrent_layers:
            raise ConfigError("the probe forward runs the model over tokens after a chain's history; a hybrid "
                              "model's recurrent layers would need their state at that point, which is not kept")
        if reduce not in REDUCTIONS:
            raise InvalidRequestError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        if not token_ids:
            raise InvalidRequestError("a probe needs at least one token")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidRequestError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if not 0 <= start <= logical_len:
            raise InvalidRequestError(f"start must be in [0, {logical_len}], got {start}")
        if start + len(token_ids) > self.max_positions:
            raise InvalidRequestError(f"a probe of {len(token_ids)} tokens from position {start} passes the model's "
                                      f"{self.max_positions} positions")
        cache = self.cache
        device = cache.spec.device
        num_layers = cache.spec.num_layers
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
        slots = [self._slots(table, table.layer_len(layer), device) for layer in range(num_layers)]
        visible = [cache.table_positions(table, layer) < start for layer in range(num_layers)]
        cols = [self._shared_columns(v) for v in visible]

        def retained(layer: int):
            k_cache, v_cache = cache.layer_kv(layer)
            s = slots[layer] if cols[layer] is None else slots[layer][cols[layer]]
            return k_cache.flatten(0, 1)[s], v_cache.flatten(0, 1)[s], visible[layer], cols[layer]

        runner = _ProbeLayerRunner(retained, self.scale, reduce, num_layers, self.backend)
        with torch.inference_mode():
            for lo in range(0, ids.shape[0], chunk_size):
                chunk = ids[lo: lo + chunk_size]
                positions = torch.arange(start + lo, start + lo + chunk.shape[0], device=device)
                self.model(chunk, positions, runner)
        scores = runner.scores
        if reduce == "mean":
            scores = [s / n for s, n in zip(scores, runner.num_reduced)]
        return [s.masked_fill(~v, 0.0) for s, v in zip(scores, visible)]

    def run_request(self, req: Request, token_ids: Sequence[int], **kw) -> list[torch.Tensor]:
        """``run`` against the KV a running request holds (logical length ``req.num_computed_tokens``)."""
        return self.run(self.cache.table(req), req.num_computed_tokens, token_ids, **kw)

    def _shared_columns(self, visible: torch.Tensor) -> torch.Tensor | None:
        """The slots every KV head sees, when all heads see the same ones and a backend is set, else None."""
        if self.backend is None or not bool((visible == visible[:1]).all()):
            return None
        return visible[0].nonzero().squeeze(1)

    def _slots(self, table: Any, n: int, device: torch.device) -> torch.Tensor:
        ps = self.cache.page_size
        pages = torch.tensor(table.pages[: -(-n // ps)], dtype=torch.int64, device=device)
        idx = torch.arange(n, device=device)
        return pages[idx // ps] * ps + idx % ps
