"""StreamingLLM eviction against a reference written from its paper's definition.

The reference is ``tests/eviction_reference.py``'s dense replay (its module docstring says how) with the method's
rule applied from its definition; kept positions, greedy tokens and masked greedy tokens must agree.
"""

import pytest

import policies.streaming_llm  # noqa: F401
from tests.eviction_reference import PROMPT_LENS, check_against_reference, make_llm, make_prompts, run_recorded


# --- references from the papers' definitions ------------------------------------------------------------------
def streaming_rule(sink, window, slack):
    def rule(rec, s, e, kept):
        for layer in kept:
            for h, row in enumerate(layer):
                if len(row) > sink + window + slack:
                    layer[h] = row[:sink] + row[-window:]
    return rule


# --- StreamingLLM ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "glm4_moe_lite"])
def test_streaming_llm_matches_reference(arch, tiny_dirs):
    cfg = dict(sink_tokens=2, window=12, slack=3)
    prompts = make_prompts(PROMPT_LENS)
    llm = make_llm(tiny_dirs[arch], "streaming_llm", cfg)
    outs, history = run_recorded(llm, prompts)
    assert max(h[-1][1][0].shape[1] for h in history.values()) <= 17
    check_against_reference(llm, prompts, outs, history, lambda P: streaming_rule(2, 12, 3))
