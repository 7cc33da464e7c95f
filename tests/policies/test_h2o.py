"""H2O eviction against a reference written from its paper's definition.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule applied from its definition; kept positions, greedy tokens and masked greedy tokens must agree.
"""

from collections import defaultdict

import pytest

import policies.h2o  # noqa: F401
from tests.eviction_reference import (
    PROMPT_LENS,
    check_against_reference,
    make_llm,
    make_prompts,
    params,
    run_recorded,
    top_positions,
)


# --- references from the papers' definitions ------------------------------------------------------------------
def h2o_rule(P, heavy, recent, evict_every):
    acc = defaultdict(float)  # (layer, head, position) -> accumulated attention

    def rule(rec, s, e, kept):
        for layer, rows in enumerate(kept):
            probs = rec.probs[layer].double()
            group = probs.shape[0] // len(rows)
            for h, row in enumerate(rows):
                received = probs[h * group:(h + 1) * group, s:e].sum(dim=(0, 1))
                for p in row:
                    acc[layer, h, p] += float(received[p])
        prefill = s < P
        for layer, rows in enumerate(kept):
            for h, row in enumerate(rows):
                if len(row) <= heavy + recent:
                    continue
                if not prefill and (not evict_every or (e - P) % evict_every):
                    continue
                cut = len(row) - recent
                score = {p: acc[layer, h, p] for p in row[:cut]}
                rows[h] = top_positions(row[:cut], score, heavy) + row[cut:]
    return rule


# --- H2O ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,evict_every", [("qwen3", 1), ("llama", 3), ("glm4_moe_lite", 1)])
def test_h2o_matches_reference(arch, evict_every, tiny_dirs):
    cfg = dict(heavy_budget=6, recent_budget=6, evict_every=evict_every)
    prompts = make_prompts(PROMPT_LENS, seed=3)
    llm = make_llm(tiny_dirs[arch], "h2o", cfg)
    outs, history = run_recorded(llm, prompts)
    check_against_reference(llm, prompts, outs, history, lambda P: h2o_rule(P, 6, 6, evict_every))
    # no prefix reuse under H2O (reused tokens would have no accumulated attention)
    again = llm.generate([prompts[2]], params(2))[0]
    assert again.num_cached_tokens == 0
