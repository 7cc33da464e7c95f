"""PyramidKV eviction against a reference written from its paper's definition, and its per-layer budgets against
the formula.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with SnapKV's rule
(``snap_rule``) under the layers' budgets from the definition (``pyramid_reference``); kept positions, greedy tokens
and masked greedy tokens must agree.
"""

import pytest

import policies.pyramidkv  # noqa: F401
from tests.eviction_reference import (
    MAX_NEW,
    check_against_reference,
    make_llm,
    make_prompts,
    pyramid_reference,
    run_recorded,
    snap_rule,
)


# --- PyramidKV ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_pyramidkv_matches_reference(arch, tiny_dirs):
    cfg = dict(budget=20, window=4, beta=4, kernel_size=5)
    prompts = make_prompts((9, 30, 70), seed=2)
    llm = make_llm(tiny_dirs[arch], "pyramidkv", cfg)
    outs, history = run_recorded(llm, prompts)
    lens = {len(o.prompt_token_ids): [k.shape[1] for k in history[o.request_id][-1][1]] for o in outs}
    # B = 16: top = 16 // 4 = 4, bottom = 28 -> (32, 8); prompt 30 clamps the bottom to 26 -> (30, 10)
    assert lens == {9: [9 + MAX_NEW - 1] * 2, 30: [30 + MAX_NEW - 1, 10 + MAX_NEW - 1],
                    70: [32 + MAX_NEW - 1, 8 + MAX_NEW - 1]}

    def budgets(P):
        return pyramid_reference(20, 4, 4, 2, P)

    check_against_reference(llm, prompts, outs, history,
                            lambda P: snap_rule(P, budgets(P), 4, 5, "max", 0, budget=20))


# --- PyramidKV budgets ----------------------------------------------------------------------------------------
def test_pyramid_budgets_follow_the_formula():
    from policies.pyramidkv import pyramid_budgets

    # B = 90, top = 90 // 20 = 4, bottom = 176; 176, 118.67, 61.33, 4 -> the one leftover unit goes to layer 1
    assert pyramid_budgets(100, 10, 20, 4, 10_000) == [186, 129, 71, 14]
    # prompt 150: prefix 140 < 176 clamps the bottom to 140 and raises the top to 40
    assert pyramid_budgets(100, 10, 20, 4, 150) == [150, 117, 83, 50]
    assert pyramid_budgets(100, 10, 1, 4, 10_000) == [100] * 4
    assert pyramid_budgets(100, 10, 20, 1, 10_000) == [100]
    for m in (2, 3, 7, 32):
        for budget, window, beta in ((2048, 32, 20), (100, 10, 3), (64, 63, 20)):
            for P in (budget + 1, budget + 50, 10 * budget):
                got = pyramid_budgets(budget, window, beta, m, P)
                assert got == pyramid_reference(budget, window, beta, m, P)
                assert sum(got) == m * budget
                assert all(a >= b for a, b in zip(got, got[1:])) and got[-1] >= window
