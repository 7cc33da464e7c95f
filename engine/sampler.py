"""Batched token sampling: greedy, temperature, top-k, top-p, min-p; the logprobs (and top logprobs) asked for.

Rows under a structured-output grammar are masked first (engine.structured_output.StepMasks): every token the
grammar forbids is at -inf before temperature and filtering, so neither greedy nor a draw can pick one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import StepMasks


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]  # per row; None where not asked


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or None (use the global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _filter_mask(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Boolean [n, V] mask of tokens kept by top-k, then top-p, then min-p; None if nothing is filtered."""
    n, vocab = x.shape
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if all(k == vocab for k in ks) and all(p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return None
    dev = x.device
    k = torch.tensor(ks, device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=x.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=x.dtype)

    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=dev)[None, :] < k[:, None]
    probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return torch.empty_like(keep).scatter_(1, order, keep)


def top_rows(params: list[SamplingParams]) -> list[int]:
    """The rows whose top logprobs ``sample_tensors`` returns, in the order of its top tensors' rows."""
    return [i for i, p in enumerate(params) if p.top_logprobs]


def top_lists(values: list[list[float]], ids: list[list[int]],
              params: list[SamplingParams]) -> list[TopLogprobs | None]:
    """Host lists of one step's top tensors (rows of ``top_rows(params)``, each ``max K`` wide) as one list per
    row of the batch: each asking row keeps its own K, the rest get None."""
    out: list[TopLogprobs | None] = [None] * len(params)
    for r, i in enumerate(top_rows(params)):
        k = params[i].top_logprobs
        out[i] = list(zip(ids[r][:k], values[r][:k]))
    return out


def fetch(tensors: list[torch.Tensor]) -> list[list]:
    """``tensors`` as host lists after a single wait for the device (``tolist`` per tensor would wait for each)."""
    if tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    ready.synchronize()
    return [h.tolist() for h in host]


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor] | None,
            params: list[SamplingParams]) -> SampleOutput:
    """One step's sampled tensors as host lists (the step's one device sync); logprobs only where asked."""
    n = len(params)
    if logprobs is None:
        return SampleOutput(token_ids=tokens.tolist(), logprobs=[None] * n, top_logprobs=[None] * n)
    host = fetch([tokens, logprobs] if top is None else [tokens, logprobs, *top])
    lps = [lp if p.logprobs else None for lp, p in zip(host[1], params)]
    tops = [None] * n if top is None else top_lists(host[2], host[3], params)
    return SampleOutput(token_ids=host[0], logprobs=lps, top_logprobs=tops)


class Sampler:
    def __init__(self) -> None:
        # the grammar masks of the next call's rows: set by the engine around a step whose batch holds
        # constrained requests (the runner calls the sampler without them), used by that step's call only
        self.step_masks: StepMasks | None = None

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        forced: list[int | None] | None = None,
        masks: StepMasks | None = None,
    ) -> SampleOutput:
        """``forced[i]``, when not None, is emitted for row i instead of a sample (its logprob and top
        logprobs are still the model's). ``masks``: the rows' grammar masks (default ``step_masks``)."""
        return to_host(*self.sample_tensors(logits, params, generators, forced, masks), params)

    def sample_tensors(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        forced: list[int | None] | None = None,
        masks: StepMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """``sample`` without the copy to the host: (tokens [n] int64, logprobs [n] fp32 of the emitted tokens
        or None when no row asks for them, top logprobs or None when no row asks for them), on the logits'
        device, with no host sync. The top logprobs are (values [m, K] fp32 descending, token ids [m, K]
        int64) for the m rows of ``top_rows(params)``, K the largest ``top_logprobs`` among them (at most the
        vocabulary): both logprobs are of the raw logits' log_softmax, before the grammar mask, temperature and
        filtering."""
        n = logits.shape[0]
        assert logits.dim() == 2 and len(params) == n and len(generators) == n
        logits = logits.float()
        masks = self.step_masks if masks is None else masks
        scores = logits if masks is None else masks.apply(logits)  # what tokens are chosen from
        greedy = [p.is_greedy for p in params]

        if all(greedy):
            tokens = scores.argmax(dim=-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            g_rows = [i for i in range(n) if greedy[i]]
            s_rows = [i for i in range(n) if not greedy[i]]
            if g_rows:
                gi = torch.tensor(g_rows, device=logits.device)
                tokens[gi] = scores[gi].argmax(dim=-1)
            si = torch.tensor(s_rows, device=logits.device)
            tokens[si] = self._sample_random(
                scores[si], [params[i] for i in s_rows], [generators[i] for i in s_rows]
            )

        if forced is not None and any(f is not None for f in forced):
            rows = [i for i, f in enumerate(forced) if f is not None]
            tokens[torch.tensor(rows, device=logits.device)] = torch.tensor(
                [forced[i] for i in rows], device=logits.device, dtype=tokens.dtype)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        if not lp_rows:
            return tokens, None, None
        if len(lp_rows) == n:
            logp = torch.log_softmax(logits, dim=-1)
            logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
        else:
            li = torch.tensor(lp_rows, device=logits.device)
            logp = torch.log_softmax(logits[li], dim=-1)  # row r is batch row lp_rows[r]
            logprobs = torch.zeros(n, dtype=torch.float32, device=logits.device)  # rows that do not ask: unused
            logprobs[li] = logp.gather(1, tokens[li, None]).squeeze(1)
        return tokens, logprobs, self._top(logp, [params[i].top_logprobs for i in lp_rows])

    @staticmethod
    def _top(logp: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``max(ks)`` most likely tokens of the rows of ``logp`` whose ``ks`` entry is not 0 (top_logprobs
        implies logprobs, so these rows are ``top_rows`` in order): one topk over just them."""
        rows = [r for r, k in enumerate(ks) if k]
        if not rows:
            return None
        if len(rows) < len(ks):
            logp = logp[torch.tensor(rows, device=logp.device)]
        return logp.topk(min(max(ks), logp.shape[1]), dim=-1, sorted=True)

    @staticmethod
    def _sample_random(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        x = logits / temps[:, None]
        keep = _filter_mask(x, params)
        if keep is not None:
            x = x.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(x, dim=-1)

        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_()
            else:
                ui = torch.tensor(unseeded, device=probs.device)
                noise[ui] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
