"""TOVA: Token Omission Via Attention.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024 (arXiv:2401.06104), Section 3.3 / the reference
code's ``TOVACache.reduce``.

Definition implemented, per layer, with budget B = ``budget`` (the multi-state size), queries and keys post-RoPE,
D = head_dim, Hq query heads, g = Hq / Hkv query heads per KV head (query head j reads KV head j // g):

1. after every step, for every request of the step whose physical length n in the layer exceeds B, take the
   query of the request's **last** token of the step (the newest token, position L - 1);
2. ``a[j, s] = softmax_s(q_{L-1}^j . k_s^{j//g} / sqrt(D))`` over all n slots the request holds in the layer
   (the kept slots plus every token of the step, the newest included) -- exactly the distribution that query
   used, recomputed from the stashed query row and the cached keys rather than asked of the backend;
3. ``score[s] = mean_j a[j, s]`` -- averaged over **all** Hq query heads of the layer;
4. the layer keeps its B slots of largest score (ties to the earlier position) and drops the rest, the newest
   token being a candidate like any other (as in the paper). One kept set per layer, **shared by every KV
   head** of the layer, as in the paper; layers choose independently.

Decoding adds one token per step, so each step drops exactly the lowest-scored slot once the request is at the
budget: the paper's rule. A prompt is handled at step granularity: after each prompt chunk the request is cut
back to B slots by the attention of the chunk's last token, and every token of a chunk saw the kept set of the
chunk's start plus the chunk's own earlier tokens (the paper's reference code likewise reduces a whole prompt at
once by its last token's attention). With ``max_num_batched_tokens`` >= the prompt this is the reference code's
behaviour exactly; a request never holds more than B slots between steps.

Scale: ``head_dim ** -0.5`` (the engine's). Prefix caching is left on: a reused prefix counts as computed by
the request's first step, and the cache never publishes pages once compacted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod, all_reduce
from engine.contract.method import HOOKS_EVERY_STEP
from engine.registry import register_method
from policies.scoring import check_int, gather_keys, keep_all, request_rows, top_k_sorted

_SCRATCH = "tova.last_query"


@dataclass(slots=True, frozen=True)
class TOVAConfig:
    budget: int = 2048  # slots kept per layer (shared by the layer's KV heads)

    def __post_init__(self) -> None:
        check_int("budget", self.budget, 1)


def last_query_scores(q_last: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q_last [Hq, D] (one query), keys [n, Hkv, D] -> fp32 [n]: its softmax attention averaged over the Hq heads."""
    hq, d = q_last.shape
    n, hkv, _ = keys.shape
    logits = torch.einsum("hgd,shd->hgs", q_last.float().reshape(hkv, hq // hkv, d), keys.float()) * d**-0.5
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


@register_method
class TOVA(SparseMethod):
    name = "tova"
    family = Family.EVICTION
    Config = TOVAConfig
    decode = HOOKS_EVERY_STEP  # select stashes each request's last query row on the host side

    def select(self, layer, q, batch):
        budget = self.config.budget
        cache = batch.cache
        stash = batch.scratch.setdefault(_SCRATCH, {})
        for req, row, n, _ in request_rows(batch):
            if cache.physical_len(req, layer) + n > budget:  # over budget once the step's tokens are committed
                stash.setdefault(req.request_id, {})[layer] = q[row + n - 1].detach().clone()
        return batch.view_for(layer)

    def end_step(self, batch):
        stash = batch.scratch.get(_SCRATCH)
        if not stash:
            return
        cache = batch.cache
        budget = self.config.budget
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        for req in batch.requests:
            rows = stash.get(req.request_id)
            if rows is None:
                continue
            keep, changed = [], False
            for layer in range(cache.spec.num_layers):
                n = cache.physical_len(req, layer)
                if n <= budget or layer not in rows:
                    keep.append(keep_all(n, heads, device))
                    continue
                score = last_query_scores(rows[layer], gather_keys(cache, req, layer, n))
                score = all_reduce(score, "mean")  # tensor parallel: the mean over every rank's heads
                keep.append(top_k_sorted(score[None], budget).expand(heads, budget))
                changed = True
            if changed:
                cache.compact(req, keep)  # on failure: retried after the request's next step
