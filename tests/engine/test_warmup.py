"""The engine's warm-up prefill (engine.warmup): one request of a full step's tokens runs before the engine takes
requests, and leaves it as it found it: every page and state slot free, nothing to match in the prefix cache, no
request id taken, and every later output equal to an engine that did not warm up."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from engine.warmup import warmup_prompt

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine_for(model_dir, **overrides):
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", page_size=4,
                                  max_num_batched_tokens=48, **overrides))


def run(engine, prompt, request_id=None):
    rid = engine.add_request(prompt, PARAMS, request_id=request_id)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "glm4_moe_lite"])
def test_the_warm_up_prefills_a_full_step_and_leaves_nothing_behind(tiny_dirs, arch, monkeypatch):
    prefilled = []
    step = LLMEngine.step

    def counted(self):
        outputs = step(self)
        prefilled.append(self.last_step.prefill_tokens)
        return outputs

    monkeypatch.setattr(LLMEngine, "step", counted)
    warm = engine_for(tiny_dirs[arch], warmup=True)
    assert warm.warmup_tokens == 48 and prefilled == [48]  # one step, the whole warm-up prompt
    monkeypatch.setattr(LLMEngine, "step", step)
    assert warm.pool.num_free == warm.pool.num_pages and not warm._requests and warm.last_step is None
    storage = warm.cache.storage
    if hasattr(storage, "free_states"):
        assert storage.free_states == warm.cache.spec.max_states
    cold = engine_for(tiny_dirs[arch], warmup=False)
    assert cold.warmup_tokens == 0
    # a prompt that starts with the warm-up's tokens finds nothing cached, and both engines answer alike
    prompt = warmup_prompt(warm)[:40] + list(range(5, 25))  # past one step: a hybrid checkpoints its state at 48
    a, b = run(warm, prompt), run(cold, prompt)
    assert a.request_id == b.request_id == "0"
    assert a.token_ids == b.token_ids and a.num_cached_tokens == b.num_cached_tokens == 0
    assert run(warm, prompt).num_cached_tokens == run(cold, prompt).num_cached_tokens > 0  # caching still on


def test_a_pool_smaller_than_a_step_skips_the_warm_up(tiny_dirs):
    engine = engine_for(tiny_dirs["llama"], warmup=True, num_pages=6)  # 24 tokens: a 48-token prompt cannot fit
    assert engine.warmup_tokens == 0 and engine.pool.num_free == 6
    assert len(run(engine, [3, 4, 5]).token_ids) == 6


def test_the_default_warms_up_on_a_gpu_at_one_rank_only(tiny_dirs):
    config = EngineConfig(model=str(tiny_dirs["llama"]))
    assert config.resolved_warmup(torch.device("cuda"), 1)
    assert not config.resolved_warmup(torch.device("cuda"), 2)
    assert not config.resolved_warmup(torch.device("cpu"), 1)
    assert engine_for(tiny_dirs["llama"]).warmup_tokens == 0  # the CPU default
    with pytest.raises(ConfigError, match="warmup"):
        EngineConfig(model=str(tiny_dirs["llama"]), warmup=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="warmup"):
        EngineConfig(model=str(tiny_dirs["llama"]), warmup="yes")
