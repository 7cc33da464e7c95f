"""Batched token sampling: greedy, temperature, top-k, top-p, min-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]


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


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor | None, params: list[SamplingParams]) -> SampleOutput:
    """One step's sampled tensors as host lists (the step's one device sync); logprobs only where asked."""
    lps = logprobs.tolist() if logprobs is not None else [None] * len(params)
    return SampleOutput(token_ids=tokens.tolist(), logprobs=[lp if p.logprobs else None for lp, p in zip(lps, params)])


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        forced: list[int | None] | None = None,
    ) -> SampleOutput:
        """``forced[i]``, when not None, is emitted for row i instead of a sample (its logprob is still the
        model's)."""
        tokens, logprobs = self.sample_tensors(logits, params, generators, forced)
        return to_host(tokens, logprobs, params)

    def sample_tensors(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        forced: list[int | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``sample`` without the copy to the host: (tokens [n] int64, logprobs [n] fp32 of the emitted tokens,
        or None when no row asks for them), on the logits' device, with no host sync."""
        n = logits.shape[0]
        assert logits.dim() == 2 and len(params) == n and len(generators) == n
        logits = logits.float()
        greedy = [p.is_greedy for p in params]

        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            g_rows = [i for i in range(n) if greedy[i]]
            s_rows = [i for i in range(n) if not greedy[i]]
            if g_rows:
                gi = torch.tensor(g_rows, device=logits.device)
                tokens[gi] = logits[gi].argmax(dim=-1)
            si = torch.tensor(s_rows, device=logits.device)
            tokens[si] = self._sample_random(
                logits[si], [params[i] for i in s_rows], [generators[i] for i in s_rows]
            )

        if forced is not None and any(f is not None for f in forced):
            rows = [i for i, f in enumerate(forced) if f is not None]
            tokens[torch.tensor(rows, device=logits.device)] = torch.tensor(
                [forced[i] for i in rows], device=logits.device, dtype=tokens.dtype)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs]
        if not lp_rows:
            return tokens, None
        if len(lp_rows) == n:
            return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        li = torch.tensor(lp_rows, device=logits.device)
        logprobs = torch.zeros(n, dtype=torch.float32, device=logits.device)  # rows that do not ask: unused
        logprobs[li] = torch.log_softmax(logits[li], dim=-1).gather(1, tokens[li, None]).squeeze(1)
        return tokens, logprobs

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
