"""Knorm eviction against a reference written from its paper's definition.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule applied from its definition; kept positions, greedy tokens and masked greedy tokens must agree.
"""

import pytest
import torch

import policies.knorm_eviction  # noqa: F401
from engine.errors import ConfigError
from tests.eviction_reference import (
    PROMPT_LENS,
    check_against_reference,
    make_llm,
    make_prompts,
    run_recorded,
)


# --- references from the papers' definitions ----------------------------------------------------------------
def top_positions_tied(candidates, score, k, engine_row=None, rtol=1e-6):
    """``top_positions``, except where scores within ``rtol`` of the k-th best straddle the cut: the norms
    are computed in fp32 by the engine and in fp64 here, so which of such near-equal positions is kept is
    below the engine's resolution, and the engine's choice (``engine_row``) is taken when it keeps every
    position that is clearly above the cut and the right number of the near-equal ones."""
    order = sorted(candidates, key=lambda p: (-score[p], p))
    if engine_row is None or len(order) <= k:
        return sorted(order[:k])
    cut = score[order[k - 1]]
    tol = rtol * abs(cut)
    sure = [p for p in candidates if score[p] > cut + tol]
    near = [p for p in candidates if abs(score[p] - cut) <= tol]
    if len(near) > k - len(sure) and set(sure) <= set(engine_row):
        chosen = [p for p in near if p in engine_row]
        if len(chosen) == k - len(sure):
            return sorted(sure + chosen)
    return sorted(order[:k])


def engine_kept_by_end(history, request_id):
    """The engine's kept positions after each step of a request, keyed by the tokens done by its end."""
    done, by_end = 0, {}
    for n, kept in history[request_id]:
        done += n
        by_end[done] = [rows.tolist() for rows in kept]
    return by_end


def knorm_rule(P, budget, recent=0, evict_every=0, slack=0, skip_layers=(), engine=None):
    """After the step completing the prompt (limit = budget) and every ``evict_every``-th decode token
    (limit = budget + slack): a (layer, KV head) holding more than the limit keeps its last ``recent`` positions
    plus the budget - recent others of smallest key L2 norm. ``engine`` (``engine_kept_by_end``) resolves
    near-ties at the cut (``top_positions_tied``)."""

    def rule(rec, s, e, kept):
        if s < P <= e:
            limit = budget
        elif s >= P and evict_every and (e - P) % evict_every == 0:
            limit = budget + slack
        else:
            return
        for layer, rows in enumerate(kept):
            if layer in skip_layers:
                continue
            k = rec.k[layer].double()
            for h, row in enumerate(rows):
                if len(row) <= limit:
                    continue
                cut = len(row) - recent
                score = {p: -float(torch.linalg.vector_norm(k[p, h])) for p in row[:cut]}
                engine_row = None if engine is None or e not in engine else engine[e][layer][h]
                rows[h] = top_positions_tied(row[:cut], score, budget - recent, engine_row) + row[cut:]
    return rule


# --- Knorm ------------------------------------------------------------------------------------------------------
# Not on the tiny Qwen3: its key RMSNorm (unit weights in the random checkpoint) gives every key the same norm,
# sqrt(head_dim), so the ranking would be decided by rounding noise.
@pytest.mark.parametrize("arch,cfg", [
    ("qwen2", dict(budget=16)),
    ("llama", dict(budget=16, recent=4, evict_every=3, slack=2)),
    ("qwen2", dict(budget=12, recent=2, evict_every=1, skip_layers=[0])),
    ("glm4_moe_lite", dict(budget=16)),  # the latent rows' norms (the latent is RMS-normed, its RoPE part not)
])
def test_knorm_matches_reference(arch, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=8)
    llm = make_llm(tiny_dirs[arch], "knorm", cfg)
    outs, history = run_recorded(llm, prompts)
    skip = tuple(cfg.get("skip_layers", ()))
    for out in outs:
        P, done = len(out.prompt_token_ids), 0
        for n, kept in history[out.request_id]:
            done += n
            if done == P:  # right after the prompt: exactly `budget` per compressed layer
                want = [P if layer in skip or P <= cfg["budget"] else cfg["budget"] for layer in range(2)]
                assert [k.shape[1] for k in kept] == want
    ref_cfg = dict(cfg, skip_layers=skip)
    engine = {len(o.prompt_token_ids): engine_kept_by_end(history, o.request_id) for o in outs}
    check_against_reference(llm, prompts, outs, history, lambda P: knorm_rule(P, **ref_cfg, engine=engine[P]))



def test_knorm_skip_layers_out_of_range_is_refused_at_configuration(tiny_dirs):
    with pytest.raises(ConfigError, match="skip_layers"):
        make_llm(tiny_dirs["qwen3"], "knorm", dict(skip_layers=[2]))
