"""The lifecycle contract: hook order, views, scores, and typed method configs; the dense path runs through it."""

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.contract import MethodNeeds, SparseMethod
from engine.contract.method import DecodeCapabilities
from engine.errors import ConfigError
from engine.registry import create_method, register_method


@dataclasses.dataclass(slots=True, frozen=True)
class ProbeConfig:
    tag: str = "x"
    window: int = 4

    def __post_init__(self):
        if self.window < 1:
            raise ValueError("window must be >= 1")


@register_method
class Probe(SparseMethod):
    """Records every hook call; checks what the runner hands a method."""

    name = "test-probe"
    Config = ProbeConfig
    needs = MethodNeeds(attention_scores=True)
    decode = DecodeCapabilities(window=1, layer_output=True)  # every step's hooks are recorded, end_layer's too
    calls: list = []

    def begin_step(self, batch):
        self.calls.append(("begin_step", batch.num_tokens))

    def before_attention(self, layer, batch):
        self.calls.append(("before_attention", layer))

    def select(self, layer, q, batch):
        view = batch.view
        assert q.shape[0] == batch.num_tokens
        assert view.kv_lens_cpu == [r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)]
        self.calls.append(("select", layer))
        return view

    def after_attention(self, layer, batch, out, scores):
        assert len(scores) == len(batch.requests)
        for s, n, kv in zip(scores, batch.view.query_lens_cpu, batch.view.kv_lens_cpu):
            assert s.shape[1:] == (n, kv)
            torch.testing.assert_close(s.sum(-1), torch.ones_like(s.sum(-1)))
            assert torch.all(s[:, -1, :].gt(0))  # the last query sees every slot
        self.calls.append(("after_attention", layer))

    def end_layer(self, layer, batch, hidden):
        assert hidden.shape[0] == batch.num_tokens
        self.calls.append(("end_layer", layer))

    def end_step(self, batch):
        self.calls.append(("end_step", len(batch.finished_prompt)))

    def release(self, req):
        self.calls.append(("release", req.request_id))


def test_hooks_run_in_contract_order_and_dense_output_is_unchanged(tiny_dirs):
    model_dir = tiny_dirs["qwen3"]
    prompts = [[7, 8, 9, 10, 11], list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    dense = LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)
    Probe.calls = []
    probed = LLM(model_dir, dtype="float32", device="cpu", method="test-probe",
                 method_config={"tag": "y"}).generate(prompts, params)
    assert [o.token_ids for o in probed] == [o.token_ids for o in dense]

    num_layers = 2
    per_layer = ["before_attention", "select", "after_attention", "end_layer"]
    expected_step = ["begin_step"] + [h for _ in range(num_layers) for h in per_layer] + ["end_step"]
    names = [c[0] for c in Probe.calls if c[0] != "release"]
    assert len(names) % len(expected_step) == 0
    for i in range(0, len(names), len(expected_step)):
        assert names[i:i + len(expected_step)] == expected_step
    layers = [c[1] for c in Probe.calls if c[0] == "select"]
    assert layers[:num_layers] == list(range(num_layers))
    assert sum(c[1] for c in Probe.calls if c[0] == "end_step") == 2  # each prompt finished prefill once
    assert sorted(c[1] for c in Probe.calls if c[0] == "release") == ["0", "1"]


def test_method_config_is_typed_and_validated():
    m = create_method("test-probe", {"window": 3})
    assert m.config == ProbeConfig(window=3)
    with pytest.raises(ConfigError, match="no option"):
        create_method("test-probe", {"budget": 3})
    with pytest.raises(ConfigError, match="window must be"):
        create_method("test-probe", {"window": 0})
    with pytest.raises(ConfigError, match="unknown method"):
        create_method("nope")
    with pytest.raises(ConfigError, match="already registered"):
        register_method(type("Other", (SparseMethod,), {"name": "test-probe"}))
