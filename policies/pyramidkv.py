"""PyramidKV: SnapKV's observation-window eviction with per-layer budgets that shrink with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069), Section 3 / the reference code's ``PyramidKVCluster``.

Scoring and selection are SnapKV's (see ``policies.snapkv``: window vote summed over the window queries,
averaged over the query heads of each KV head, 1D pooling, top-k per KV head plus the whole window); only the
number of kept slots differs per layer. With w = ``window``, m layers and B = ``budget - w`` the mean prefix
budget per layer:

* top (last) layer: ``b_top = B // beta``; bottom (first) layer: ``b_bot = 2 B - b_top`` (the reference
  code's ``min_num`` / ``max_num``);
* if the prompt's prefix is shorter than the bottom layer's share (``P - w < b_bot``) the bottom is clamped
  to ``P - w`` and the top raised to ``2 B - (P - w)`` (as the reference code does), so the mean stays B.
  Unlike the reference code, prompts with ``P < 2 B`` are not switched to a uniform SnapKV budget: the
  clamped pyramid is used for every prompt longer than ``budget``;
* layer l gets the arithmetic progression ``b_l = b_bot - (b_bot - b_top) l / (m - 1)``, rounded to
  integers by largest remainder (floors, then +1 to the layers with the largest fractional parts, ties to the
  lower layer), so ``sum_l b_l == m B`` exactly -- the mean kept budget is exactly ``budget`` -- and the
  sequence stays non-increasing (the reference code's integer step ``(max - min) // (m - 1)`` does not keep
  the mean);
* layer l keeps ``w + b_l`` slots per KV head (all of them when that is >= P).

A prompt of at most ``budget`` tokens is kept whole. ``reeval_every`` re-evicts each layer to its own budget.

Chain turns (Chain Cache): as SnapKV's (see ``policies.snapkv``): at the end of each turn's prompt, the last w
queries of the turn's prompt vote over everything each layer holds (retained, possibly compacted, KV plus
the new suffix, at their logical positions), and each layer holding more than its budget is trimmed back to
it. The budgets are recomputed per turn from the turn's **logical** prompt length P (the whole history), so
the clamp above relaxes as the chain grows and a layer's budget can shrink from one turn to the next (the
bottom one grows towards ``2 B - b_top``, the top one shrinks towards ``b_top``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.registry import register_method
from policies.scoring import check_int
from policies.snapkv import SnapKV, SnapKVConfig


def pyramid_budgets(budget: int, window: int, beta: int, num_layers: int, prompt_len: int) -> list[int]:
    """Kept slots (window included) of each layer, bottom layer first; see the module docstring."""
    mean = budget - window
    top = mean // beta
    bottom = 2 * mean - top
    if budget < prompt_len and prompt_len - window < bottom:
        bottom = prompt_len - window
        top = 2 * mean - bottom
    m = num_layers
    if m == 1:
        return [budget]
    # b_l = (bottom (m - 1) - (bottom - top) l) / (m - 1), exactly in integers
    nums = [bottom * (m - 1) - (bottom - top) * layer for layer in range(m)]
    floors = [x // (m - 1) for x in nums]
    extra = m * mean - sum(floors)
    by_remainder = sorted(range(m), key=lambda layer: (-(nums[layer] % (m - 1)), layer))
    for layer in by_remainder[:extra]:
        floors[layer] += 1
    return [window + b for b in floors]


@dataclass(slots=True, frozen=True)
class PyramidKVConfig(SnapKVConfig):
    beta: int = 20  # top layer keeps (budget - window) // beta prefix slots

    def __post_init__(self) -> None:
        SnapKVConfig.__post_init__(self)
        check_int("beta", self.beta, 1)


@register_method
class PyramidKV(SnapKV):
    name = "pyramidkv"
    Config = PyramidKVConfig

    def layer_budgets(self, num_layers: int, prompt_len: int) -> list[int]:
        c = self.config
        return pyramid_budgets(c.budget, c.window, c.beta, num_layers, prompt_len)
