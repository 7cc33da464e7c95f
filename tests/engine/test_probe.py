"""The probe forward against a dense full-matrix reference, and the chain left byte-for-byte unchanged."""

import copy
import random

import pytest
import torch

import policies.knorm  # noqa: F401  (registers "knorm")
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.chain_helpers import random_tokens, run_chain_turn
from tests.dense_reference import RecordingRunner

PAGE = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def dense_probe_reference(model, history, probe, kept, start, reduce):
    """Score of each kept slot: the dense attention probabilities of the probe rows (positions start..) on it.

    The history rows see causally; probe row i sees the kept history slots of its KV head with position
    < start and probe rows <= i. ``kept[layer]`` is [Hkv, n] logical positions."""
    seq = history[:start] + probe
    T, P = len(seq), len(probe)

    def visible(layer, T_):
        heads = kept[layer].shape[0]
        m = torch.ones(T_, T_, dtype=torch.bool).tril().repeat(heads, 1, 1)
        for h in range(heads):
            row = torch.zeros(start, dtype=torch.bool)
            row[[p for p in kept[layer][h].tolist() if p < start]] = True
            m[h, start:, :start] &= row
        return m

    runner = RecordingRunner(visible)
    with torch.no_grad():
        model(torch.tensor(seq), torch.arange(T), runner)
    out = []
    for layer, positions in enumerate(kept):
        probs = runner.probs[layer][:, T - P:, :]  # [Hq, P, T]
        heads = positions.shape[0]
        group = probs.shape[0] // heads
        score = torch.zeros(positions.shape)
        for h in range(heads):
            for s, pos in enumerate(positions[h].tolist()):
                if pos >= start:
                    continue
                cells = probs[h * group:(h + 1) * group, :, pos]
                score[h, s] = cells.max() if reduce == "max" else cells.mean()
        out.append(score)
    return out


def chain_snapshot(engine, chain_id):
    state = engine.chains.index.get(chain_id)
    t = state.table
    return (engine.cache.storage.kv.clone(), list(t.pages), t.num_slots, None if t.layer_lens is None else list(t.layer_lens),
            [engine.cache.table_positions(t, layer).clone() for layer in range(engine.model_config.num_layers)],
            list(engine.pool.ref_counts), engine.pool.num_free, state.num_computed, list(state.token_ids))


def assert_unchanged(before, after):
    assert torch.equal(before[0], after[0])  # every byte of the KV storage
    assert before[1:4] == after[1:4]
    assert all(torch.equal(a, b) for a, b in zip(before[4], after[4]))
    assert before[5:] == after[5:]


@pytest.fixture(scope="module")
def chain_engine(tiny_dirs):
    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16)
    engine, rng = llm.engine, random.Random(1)
    prompt = random_tokens(rng, 37)
    run_chain_turn(engine, "c", prompt, PARAMS)
    return engine, rng


def prober_for(engine, path):
    """The engine's prober ("backend": attention through the engine's backend where every KV head of a layer
    sees the same slots) or a copy that always forms the full probability matrix ("reference")."""
    if path == "backend":
        assert engine.chains.prober.backend is engine.backend
        return engine.chains.prober
    reference = copy.copy(engine.chains.prober)
    reference.backend = None
    return reference


@pytest.mark.parametrize("path", ["backend", "reference"])
@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("pruned", [False, True])
def test_probe_scores_equal_dense_attention_and_the_chain_is_unchanged(chain_engine, reduce, pruned, path):
    engine, rng = chain_engine
    prober = prober_for(engine, path)
    chain = f"p-{reduce}-{pruned}-{path}"
    engine.fork_chain("c", chain)
    if pruned:  # per-head kept sets (knorm) make the retained slots non-contiguous and differ between heads
        engine.prune_chain(chain, [(5, 30)], scorer="knorm", keep_ratio=0.4)
    state = engine.chains.index.get(chain)
    num_layers = engine.model_config.num_layers
    kept = [engine.cache.table_positions(state.table, layer).clone() for layer in range(num_layers)]
    history = state.token_ids[: state.num_computed]
    probe = random_tokens(rng, 11)
    before = chain_snapshot(engine, chain)

    got = prober.run(state.table, state.num_computed, probe, reduce=reduce, chunk_size=4)
    assert_unchanged(before, chain_snapshot(engine, chain))

    expected = dense_probe_reference(engine.model, history, probe, kept, state.num_computed, reduce)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    whole = prober.run(state.table, state.num_computed, probe, reduce=reduce, chunk_size=64)
    for g, w in zip(got, whole):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    engine.delete_chain(chain)


@pytest.mark.parametrize("pruned", [False, True])
def test_probe_from_an_earlier_start_reproduces_the_histories_own_attention(chain_engine, pruned):
    """Re-running w tokens of the history at their own positions (from ``start``) gives exactly the attention
    those tokens' queries paid to the earlier KV when the history was computed. Pruned per head inside
    [5, 30) and started at 18, the heads of a layer see different slots: the probe takes its full-matrix path."""
    engine, _ = chain_engine
    chain = f"early-{pruned}"
    engine.fork_chain("c", chain)
    if pruned:
        engine.prune_chain(chain, [(5, 30)], scorer="knorm", keep_ratio=0.4)
    state = engine.chains.index.get(chain)
    n, w = state.num_computed, 6
    start = 18 if pruned else n - w
    history = state.token_ids[:n]
    kept = [engine.cache.table_positions(state.table, layer).clone() for layer in range(engine.model_config.num_layers)]
    assert pruned != all(bool((p[:1] < start).eq(p < start).all()) for p in kept)  # heads see different slots
    probe = history[start: start + w]
    got = engine.chains.prober.run(state.table, n, probe, start=start, reduce="mean", chunk_size=4)
    expected = dense_probe_reference(engine.model, history, probe, kept, start, "mean")
    for g, e, positions in zip(got, expected, kept):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
        assert torch.all(g[positions >= start] == 0)  # slots at or after start are hidden from the probe
    engine.delete_chain(chain)


def test_probe_rejects_bad_input(chain_engine):
    engine, _ = chain_engine
    state = engine.chains.index.get("c")
    prober, n = engine.chains.prober, state.num_computed
    for kw, words in [(dict(token_ids=[]), "at least one token"), (dict(token_ids=[5], reduce="sum"), "reduce"),
                      (dict(token_ids=[5], chunk_size=0), "chunk_size"), (dict(token_ids=[5], start=n + 1), "start"),
                      (dict(token_ids=[5] * (prober.max_positions - n + 1)), "positions")]:
        with pytest.raises(InvalidRequestError, match=words):
            prober.run(state.table, n, **kw)
