"""TOVA eviction against a reference written from its paper's definition.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule applied from its definition; kept positions, greedy tokens and masked greedy tokens must agree.
"""

import pytest
import torch

import policies.tova  # noqa: F401
from tests.eviction_reference import (
    PROMPT_LENS,
    check_against_reference,
    make_llm,
    make_prompts,
    run_recorded,
    top_positions,
)


# --- references from the papers' definitions ----------------------------------------------------------------
def tova_rule(budget):
    """After every step, a layer holding more than ``budget`` positions keeps the ``budget`` of largest attention
    from the step's last query (the probabilities it actually used), averaged over all query heads; one set per
    layer for every KV head."""

    def rule(rec, s, e, kept):
        for layer, rows in enumerate(kept):
            row = rows[0]
            assert all(r == row for r in rows)
            if len(row) <= budget:
                continue
            probs = rec.probs[layer][:, e - 1].double()  # [Hq, T]: the newest token's attention
            hq = probs.shape[0]
            assert all(abs(float(probs[j, row].sum()) - 1) < 1e-5 for j in range(hq))  # it saw exactly `row`
            score = {p: sum(float(probs[j, p]) for j in range(hq)) / hq for p in row}
            chosen = top_positions(row, score, budget)
            for h in range(len(rows)):
                rows[h] = list(chosen)
    return rule


def kept_lengths(history):
    """Per step, the physical length of each layer (after the step's eviction)."""
    return [[k.shape[1] for k in kept] for _, kept in history]


# --- TOVA -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_tova_matches_reference(arch, tiny_dirs):
    budget = 12
    prompts = make_prompts(PROMPT_LENS, seed=7)
    llm = make_llm(tiny_dirs[arch], "tova", dict(budget=budget))
    outs, history = run_recorded(llm, prompts)
    for out in outs:
        for _, kept in history[out.request_id]:
            for k in kept:  # never over budget between steps; one kept set shared by the layer's KV heads
                assert k.shape[1] <= budget and all(torch.equal(k[0], row) for row in k)
        if len(out.prompt_token_ids) > budget:
            assert kept_lengths(history[out.request_id])[-1] == [budget, budget]
    check_against_reference(llm, prompts, outs, history, lambda P: tova_rule(budget))
