"""GPU backends agree with the torch reference backend (runs only where CUDA is available): Triton,
flashinfer, and Triton with flashinfer's prefill (``triton+flashinfer``) when flashinfer is installed.

fp32: greedy tokens equal. bf16: the logits of every step before the first differing token agree within
1e-2 relative error. Batched mixed-length prompts, chunked prefill, prefix hits, and decode CUDA graphs.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


def backends():
    names = ["triton"]
    try:
        import flashinfer  # noqa: F401

        names += ["flashinfer", "triton+flashinfer"]
    except Exception:  # noqa: BLE001
        pass
    return names


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(48)]
    out = []
    for i, n in enumerate([5, 300, 17, 64, 130, 33, 8, 250]):
        body = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(system + body if i % 2 == 0 else body)
    return out


def run(model_dir, backend: str, dtype: str, eager: bool = True, forced_routes: list | None = None):
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cuda", dtype=dtype, attention_backend=backend, max_num_batched_tokens=64,
              enforce_eager=eager, max_num_seqs=16, kv_cache_memory_bytes=256 * 2**20,
              overlap_decode=False)  # plain steps: every step's logits pass the sampler recorded below
    logits_log, routes, pending = [], [], []
    sample = llm.engine.runner.sampler.sample

    def recording(logits, *args):
        logits_log.append(logits.float().cpu())
        routes.append(list(pending))  # the experts every MoE layer chose for every token of this step
        pending.clear()
        return sample(logits, *args)

    llm.engine.runner.sampler.sample = recording
    record_routes(llm.engine.model, pending, forced_routes)
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(ps[:1], params)  # warm the prefix cache
    outs = llm.generate(ps, params)
    return [o.token_ids for o in outs], (logits_log, routes), [o.num_cached_tokens for o in outs]


def record_routes(model, out: list, forced: list | None = None) -> None:
    """Append each MoE layer's chosen experts (sorted per token) to ``out`` at every forward (eager steps).
    ``forced``: another run's routes in the order they were recorded, taken instead of this run's own (the
    weights are still this run's router probabilities at those experts)."""
    from engine.models.moe import SparseMoeBlock

    forced = None if forced is None else list(forced)
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            def route(x, router_logits=None, _route=m.route, _block=m):
                ids, weights = _route(x, router_logits)
                if forced:
                    ids = forced.pop(0).to(ids.device)
                    logits = _block.gate(x) if router_logits is None else router_logits
                    probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)
                    if _block.norm_topk_prob:
                        probs = probs / probs.sum(dim=-1, keepdim=True)
                    weights = probs.to(logits.dtype)
                out.append(ids.sort(dim=-1).values.cpu())
                return ids, weights
            m.route = route


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", backends())
def test_fp32_greedy_tokens_match_torch_backend(arch, backend, tiny_dirs):
    if backend == "flashinfer":
        from engine.errors import ConfigError

        with pytest.raises(ConfigError, match="does not run torch.float32"):
            run(tiny_dirs[arch], backend, "float32")
        return
    ref, _, cached = run(tiny_dirs[arch], "torch", "float32")
    assert max(cached) > 0
    for eager in (True, False) if backend != "flashinfer" else (True,):
        got, _, _ = run(tiny_dirs[arch], backend, "float32", eager=eager)
        assert got == ref, f"{backend} eager={eager}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", backends())
def test_bf16_logits_match_torch_backend(arch, backend, tiny_dirs_hf_init):
    """Every step's logits agree until the runs take a different discrete decision (a greedy token). MoE: a bf16
    rounding can flip a near-tied router top-k (HF-init routers are nearly uniform), after which the two runs
    would compute different functions, so the run under test takes the reference's experts (MoE runs eager, so
    every forward's routes are recorded and replayed)."""
    ref_tokens, (ref_logits, ref_routes), _ = run(tiny_dirs_hf_init[arch], "torch", "bfloat16")
    eager = backend == "flashinfer" or arch == "qwen3_moe"  # graph replays run no Python: no routes recorded
    forced = [r for step in ref_routes for r in step]
    tokens, (logits, routes), _ = run(tiny_dirs_hf_init[arch], backend, "bfloat16", eager=eager, forced_routes=forced)
    compared, stop = 0, "ran out of steps"
    for a, b, ra, rb in zip(ref_logits, logits, ref_routes, routes):
        if a.shape != b.shape or len(ra) != len(rb) or not all(torch.equal(x, y) for x, y in zip(ra, rb)):
            stop = f"step {compared}: logits {tuple(a.shape)} vs {tuple(b.shape)}, other routes"
            break
        err = ((a - b).norm() / a.norm()).item()
        assert err <= 1e-2, f"step {compared}: relative error {err:.2e}"
        compared += 1
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            stop = f"step {compared - 1}: a greedy token differs"
            break
    assert compared >= 2, f"{stop} ({len(ref_logits)} vs {len(logits)} steps recorded)"


def test_auto_takes_flashinfers_prefill_when_installed(tiny_dirs):
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(tiny_dirs["qwen3"], device="cuda", dtype="float32", num_pages=64))
    assert engine.backend.name == ("triton+flashinfer" if "flashinfer" in backends() else "triton")


def test_flashinfer_refuses_head_dims_its_kernels_lack(tiny_dirs):
    if "flashinfer" not in backends():
        pytest.skip("flashinfer is not installed")
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="does not run head_dim 16"):
        run(tiny_dirs["llama"], "flashinfer", "bfloat16")


@pytest.mark.parametrize("method,cfg", [("pyramidkv", {"budget": 96, "window": 8}), ("kvzip", {"budget": 48}),
                                        ("quest", {"token_budget": 32, "dense_layers": 0}),
                                        ("omnikv", {"observation_layers": [0], "token_budget": 32})])
def test_fp32_graphs_with_per_layer_lengths_match_eager(method, cfg, tiny_dirs):
    """Eviction with per-layer budgets: decode steps replay graphs over per-layer lengths, same tokens.
    Selection (Quest, OmniKV): the decode graphs capture the selection itself, same tokens."""
    from engine import LLM, SamplingParams

    outs = []
    for eager in (True, False):
        llm = LLM(tiny_dirs["llama"], device="cuda", dtype="float32", attention_backend="triton",
                  max_num_batched_tokens=64, enforce_eager=eager, max_num_seqs=16, method=method,
                  method_config=cfg, enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20)
        ps = prompts(llm.engine.model_config.vocab_size)
        outs.append([o.token_ids for o in llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True))])
        if not eager:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("storage,cfg", [("fp8", {}), ("kivi", {"bits": 4, "group_size": 16, "residual": 32}),
                                         ("kivi", {"bits": 2, "group_size": 16, "residual": 16}),
                                         ("turboquant", {"bits": 3}), ("palu", {"rank_ratio": 1.0})])
def test_fp32_graphs_over_coded_kv_match_eager(storage, cfg, tiny_dirs_hf_init):
    """Coded KV: decode steps replay graphs whose static views are the coded views (KIVI: with its windows,
    the writes planned on the device inside the graph), the fused decode kernels compiled; same tokens as
    eager steps, and with 4 decode steps per schedule too."""
    from engine import LLM, SamplingParams

    outs = []
    for eager, steps in ((True, 1), (False, 1), (False, 4)):
        llm = LLM(tiny_dirs_hf_init["llama"], device="cuda", dtype="float32", attention_backend="triton",
                  max_num_batched_tokens=64, enforce_eager=eager, max_num_seqs=16, kv_storage=storage,
                  kv_storage_config=cfg, enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20,
                  decode_steps=steps)
        ps = prompts(llm.engine.model_config.vocab_size)
        outs.append([o.token_ids for o in llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True))])
        if not eager:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    assert outs[0] == outs[1] == outs[2]
