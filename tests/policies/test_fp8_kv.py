"""The FP8 KV codec against its definition: reconstruction error within E4M3 rounding, StreamingLLM over fp8 KV
against the incremental dense reference (tests/codec_reference.py) with E4M3 rounding (through torch's float8
dtype) applied where attention reads, prefix hits and chain turns against fresh runs.
"""

import torch

import policies.streaming_llm  # noqa: F401  (registers the method)
from engine import SamplingParams
from engine.registry import create_kv_storage
from tests.codec_reference import kv_samples, make_llm, prompts, record_steps, replay, roundtrip


# --- the definition, written independently of policies/ -------------------------------------------------------
def fp8_roundtrip(x):
    """Per (token, head): scale = amax / 448, E4M3 round-to-nearest of x / scale."""
    scale = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


# --- reconstruction -------------------------------------------------------------------------------------------
def test_fp8_error_within_e4m3_rounding(tiny_dirs):
    codec = create_kv_storage("fp8")
    for _, k, v in kv_samples(tiny_dirs):
        for side, x in (("key", k), ("value", v)):
            got = roundtrip(codec, side, x)
            scale = x.abs().amax(-1, keepdim=True) / 448
            bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
            assert ((got - x).abs() <= bound).all()
            torch.testing.assert_close(got, fp8_roundtrip(x), rtol=0, atol=0)


# --- attention and tokens -------------------------------------------------------------------------------------
def test_streaming_llm_with_fp8_matches_reference(tiny_dirs):
    sink, window = 2, 12
    llm = make_llm(tiny_dirs["llama"], "fp8", method="streaming_llm",
                   mcfg={"sink_tokens": sink, "window": window, "slack": 0})
    steps = record_steps(llm)
    ps = prompts([70, 40])
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))

    def readout(layer, k, v, n):
        return fp8_roundtrip(k.float()), fp8_roundtrip(v.float())

    def rule(row):
        return row if len(row) <= sink + window else row[:sink] + row[-window:]

    for out, p in zip(outs, ps):
        assert out.token_ids == replay(llm.engine.model, p, steps[out.request_id], readout, 16, rule)


# --- prefix reuse, chains -------------------------------------------------------------------------------------
def test_fp8_prefix_hits_and_chain_turns_equal_fresh_runs(tiny_dirs):
    """Token-local codes do not depend on the schedule: a prefix hit, a resumed chain turn and a fork give
    the tokens of a fresh fp8 run on the whole history."""
    from tests.chain_helpers import run_chain_turn

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fresh = make_llm(tiny_dirs["qwen3"], "fp8", enable_prefix_caching=False)

    def ref(p):
        return fresh.generate([p], params)[0].token_ids

    llm = make_llm(tiny_dirs["qwen3"], "fp8")
    eng = llm.engine
    p1 = prompts([37])[0]
    first = llm.generate([p1], params)[0]
    again = llm.generate([p1], params)[0]
    assert first.token_ids == again.token_ids == ref(p1) and again.num_cached_tokens == 32
    h = p1 + run_chain_turn(eng, "c", p1, params).token_ids
    eng.fork_chain("c", "d")
    for cid, extra in (("c", [5, 6, 7]), ("d", [9] * 11)):
        out = run_chain_turn(eng, cid, h + extra, params)
        assert out.resume_status == "resumed" and out.token_ids == ref(h + extra)
    for cid in ("c", "d"):
        eng.delete_chain(cid)
    eng.clear_prefix_cache()
    assert eng.pool.num_free == eng.pool.num_pages
