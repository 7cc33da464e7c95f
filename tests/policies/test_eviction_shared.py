"""StreamingLLM, SnapKV, PyramidKV and H2O together: a budget covering the sequence reproduces dense, invalid
knobs, registration. Each method against the reference written from its paper's definition:
tests/policies/test_streaming_llm.py, test_snapkv.py, test_pyramidkv.py, test_h2o.py; TOVA, Knorm and R-KV
together: test_eviction_shared_tova_knorm_rkv.py; the methods across the turns of a chain: test_chain_eviction.py.
"""

from types import SimpleNamespace

import pytest
import torch

import policies.h2o  # noqa: F401  (registers the methods)
import policies.pyramidkv
import policies.snapkv  # noqa: F401
import policies.streaming_llm  # noqa: F401
from engine.errors import ConfigError
from engine.registry import create_method
from tests.eviction_reference import PROMPT_LENS, make_llm, make_prompts, params, run_recorded


# --- dense when the budget covers the prompt ------------------------------------------------------------------
@pytest.mark.parametrize("method,cfg", [
    ("streaming_llm", dict(sink_tokens=4, window=74, slack=0)),
    ("snapkv", dict(budget=70, window=8)),
    ("pyramidkv", dict(budget=70, window=8)),
    ("h2o", dict(heavy_budget=40, recent_budget=37)),
])
def test_budget_covering_the_sequence_reproduces_dense(method, cfg, tiny_dirs):
    prompts = make_prompts(PROMPT_LENS, seed=4)
    dense = make_llm(tiny_dirs["qwen3"]).generate(prompts, params())
    llm = make_llm(tiny_dirs["qwen3"], method, cfg)
    outs, history = run_recorded(llm, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for out in outs:  # nothing was ever evicted
        for _, kept in history[out.request_id]:
            assert all(torch.equal(k, torch.arange(k.shape[1]).expand_as(k)) for k in kept)


# --- configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [
    ("streaming_llm", {"window": 0}),
    ("streaming_llm", {"sink_tokens": -1}),
    ("streaming_llm", {"slack": 1.5}),
    ("streaming_llm", {"windw": 4}),
    ("snapkv", {"window": 0}),
    ("snapkv", {"budget": 8, "window": 16}),
    ("snapkv", {"kernel_size": 4}),
    ("snapkv", {"pooling": "median"}),
    ("snapkv", {"reeval_every": -1}),
    ("snapkv", {"budget": True}),
    ("pyramidkv", {"beta": 0}),
    ("pyramidkv", {"kernel_size": 0}),
    ("h2o", {"heavy_budget": 0, "recent_budget": 0}),
    ("h2o", {"recent_budget": -2}),
    ("h2o", {"evict_every": -1}),
    ("h2o", {"budget": 10}),
])
def test_invalid_knobs_raise_config_error(method, options):
    with pytest.raises(ConfigError, match=method):
        create_method(method, options)


def test_methods_register_with_family_and_defaults():
    from engine.contract import Family

    for name in ("streaming_llm", "snapkv", "pyramidkv", "h2o"):
        m = create_method(name)
        assert m.family is Family.EVICTION and m.name == name
    assert create_method("snapkv").config == policies.snapkv.SnapKVConfig(2048, 32, 7, "max", 0)
    assert create_method("pyramidkv").config.beta == 20
    assert create_method("h2o").needs.received_attention
    # only StreamingLLM (end_step only) lets decode steps replay CUDA graphs whatever the request's state (here:
    # one still in its prompt; StreamingLLM reads the slots a request holds from its cache)
    in_prompt = SimpleNamespace(request_id="r", num_prompt_tokens=8, num_computed_tokens=0, num_preemptions=0)
    methods = [create_method(n) for n in ("streaming_llm", "snapkv", "pyramidkv", "h2o")]
    methods[0].bind(SimpleNamespace(table=lambda req: SimpleNamespace(num_slots=0)))
    assert [m.decode_capabilities(in_prompt).replay for m in methods] == \
        [True, False, False, False]
