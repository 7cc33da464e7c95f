"""TOVA, Knorm and R-KV together: a budget covering the sequence reproduces dense, invalid knobs, registration,
and admission under a bounded method. Each method against the reference written from its paper's definition:
tests/policies/test_tova.py, test_knorm.py, test_rkv.py; StreamingLLM, SnapKV, PyramidKV and H2O together:
test_eviction_shared.py.
"""

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

import policies.knorm_eviction
import policies.rkv
import policies.tova  # noqa: F401
from engine import LLM, SamplingParams
from engine.contract import Family
from engine.errors import ConfigError
from engine.registry import create_method
from tests.eviction_reference import (
    PROMPT_LENS,
    make_llm,
    make_prompts,
    params,
    run_recorded,
)


# --- dense when the budget covers the sequence ----------------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [
    ("tova", dict(budget=77)),
    ("knorm", dict(budget=77, evict_every=1)),
    ("rkv", dict(budget=70, buffer=8, alpha=8)),
])
def test_budget_covering_the_sequence_reproduces_dense(method, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=11)  # longest: 70 + 8 generated, 77 computed
    dense = make_llm(tiny_dirs["qwen3"]).generate(prompts, params())
    llm = make_llm(tiny_dirs["qwen3"], method, cfg)
    outs, history = run_recorded(llm, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for out in outs:
        for _, kept in history[out.request_id]:
            assert all(torch.equal(k, torch.arange(k.shape[1]).expand_as(k)) for k in kept)


# --- configuration ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("tova", {"budget": 0}),
    ("tova", {"budget": True}),
    ("tova", {"budget": 1.5}),
    ("tova", {"window": 4}),
    ("knorm", {"budget": 0}),
    ("knorm", {"budget": 8, "recent": 9}),
    ("knorm", {"recent": -1}),
    ("knorm", {"evict_every": -1}),
    ("knorm", {"slack": 0.5}),
    ("knorm", {"skip_layers": "0"}),
    ("knorm", {"skip_layers": [-1]}),
    ("knorm", {"skip_layers": [1, 1]}),
    ("rkv", {"alpha": 0}),
    ("rkv", {"budget": 8, "alpha": 8}),
    ("rkv", {"buffer": 0}),
    ("rkv", {"mix_lambda": 1.5}),
    ("rkv", {"mix_lambda": True}),
    ("rkv", {"kernel_size": 4}),
    ("rkv", {"threshold": 2.0}),
    ("rkv", {"gqa_pooling": "median"}),
    ("rkv", {"lambda": 0.1}),
])
def test_invalid_knobs_raise_config_error(method, options):
    with pytest.raises(ConfigError, match=method):
        create_method(method, options)


def test_methods_register_with_family_defaults_and_entry_points():
    assert {"tova", "knorm", "rkv"} <= {ep.name for ep in entry_points(group="agentrt.methods")}
    for name in ("tova", "knorm", "rkv"):
        m = create_method(name)
        assert m.family is Family.EVICTION and m.name == name
        assert not m.needs.attention_scores
    assert create_method("tova").config == policies.tova.TOVAConfig(2048)
    assert create_method("knorm").config == policies.knorm_eviction.KnormConfig(2048, 0, 0, 0, ())
    assert create_method("rkv").config == policies.rkv.RKVConfig(512, 128, 8, 0.1, 7, 0.5, "max")
    assert create_method("knorm", {"skip_layers": [0, 1]}).config.skip_layers == (0, 1)
    # Knorm only overrides end_step, so decode steps may replay CUDA graphs whatever the request's state (here:
    # one still in its prompt); TOVA and R-KV stash queries in select
    in_prompt = SimpleNamespace(request_id="r", num_prompt_tokens=8, num_computed_tokens=0, num_preemptions=0)
    assert [create_method(n).decode_capabilities(in_prompt).replay for n in ("tova", "knorm", "rkv")] == \
        [False, True, False]


def test_admission_reserves_what_a_bounded_method_holds_not_the_dense_length(tiny_dirs):
    """R-KV and StreamingLLM bound a request's KV, so a generation longer than the whole pool is admitted and
    runs; the dense method refuses it."""
    from engine.errors import InvalidRequestError

    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="pages"):
        LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, num_pages=20).generate([prompt], params)
    for method, cfg in [("rkv", {"budget": 32, "buffer": 16, "alpha": 4}),
                        ("streaming_llm", {"sink_tokens": 4, "window": 28, "slack": 8})]:
        llm = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4, num_pages=20, method=method,
                  method_config=cfg, max_num_batched_tokens=16)
        out = llm.generate([prompt], params)[0]
        assert len(out.token_ids) == 200 and llm.engine.scheduler.num_preemptions == 0
