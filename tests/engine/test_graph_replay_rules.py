"""Which decode steps a method lets replay a captured CUDA graph (``DecodeCapabilities.replay``, per request
from ``SparseMethod.decode_capabilities``).

A replay runs no per-layer hook, so a method may only allow it on steps where its hooks would do nothing.
Checked on the CPU by recording the method's answer at every step of a real run.
"""

import random

import policies.snapkv  # noqa: F401  (registers the method)
from engine import LLM, SamplingParams
from engine.model_runner import replays_captured_graph
from engine.registry import create_method
from tests.chain_helpers import random_tokens


def _answers(llm, chain_id=None, reeval_every=0):
    engine = llm.engine
    seen = []

    def record(batch):
        answer = replays_captured_graph(engine.method, engine.method, batch)
        seen.append((batch.view.is_pure_decode and not batch.finished_prompt, answer))
        return answer

    engine.runner._can_replay = lambda batch: record(batch) and False  # no graphs on the CPU: just ask
    rid = engine.add_request(random_tokens(random.Random(1), 40),
                             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), chain_id=chain_id)
    while engine.has_unfinished():
        engine.step()
    return rid, seen


def _llm(model_dir, **cfg):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=16, num_pages=64,
               method="snapkv", method_config={"budget": 16, "window": 4, **cfg})


def test_dense_always_replays():
    assert create_method("dense", {}).decode_capabilities(None).replay is True


def test_snapkv_replays_only_after_its_prompt_eviction(tiny_dirs):
    _, seen = _answers(_llm(tiny_dirs["llama"]))
    prefill = [a for decode, a in seen if not decode]
    decode = [a for decode, a in seen if decode]
    assert prefill and not any(prefill)  # prompt chunks need their queries stashed
    assert decode and all(decode)


def test_snapkv_chain_turns_replay_after_their_prompt_eviction(tiny_dirs):
    """A chain's next turn recomputes its window (``resume_limit``), so decode queries are never needed later."""
    _, seen = _answers(_llm(tiny_dirs["llama"]), chain_id="c")
    decode = [a for decode, a in seen if decode]
    assert decode and all(decode) and not any(a for d, a in seen if not d)


def test_snapkv_never_replays_when_queries_may_be_needed_later(tiny_dirs):
    _, seen = _answers(_llm(tiny_dirs["llama"], reeval_every=2))  # re-evaluation votes with decode queries
    assert not any(a for _, a in seen)
