import math

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.sampler import Sampler, SampleOutput, make_generator
from engine.sampling_params import SamplingParams

V = 12


def rand_logits(n: int, v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2.0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": None}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": "0"}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"max_tokens": False}, "max_tokens"),
        ({"seed": "42"}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 7}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ],
)
def test_invalid_params_name_the_field(kwargs, name):
    with pytest.raises(InvalidSamplingParamsError, match=name):
        SamplingParams(**kwargs)


def test_valid_params_and_normalisation():
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy
    assert SamplingParams().stop is not p.stop
    p = SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, seed=3, stop="END", stop_token_ids=(2, 5))
    assert p.is_greedy and isinstance(p.temperature, float)
    assert p.stop == ["END"] and p.stop_token_ids == [2, 5]
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert isinstance(InvalidSamplingParamsError("x"), ValueError)


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = rand_logits(6)
    logits[2] = 0.0  # all tied: lowest index wins
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert isinstance(out, SampleOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 0
    assert out.logprobs == [None] * 6


def test_top_k_1_is_greedy():
    logits = rand_logits(8)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    gens = [make_generator(i, "cpu") for i in range(4)] + [None] * 4
    for _ in range(5):
        assert Sampler().sample(logits, params, gens).token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0), SamplingParams(top_p=1e-6)]
    out = Sampler().sample(logits, params, [None, make_generator(1, "cpu"), None, None])
    assert out.token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- reproducibility


def _run(logits_seq, params, seeds, steps):
    gens = [make_generator(s, "cpu") for s in seeds]
    sampler = Sampler()
    return [sampler.sample(logits_seq[t], params, gens).token_ids for t in range(steps)]


def test_seed_reproducible_and_batch_independent():
    steps = 30
    target = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=1234)
    row = [rand_logits(1, seed=100 + t) for t in range(steps)]

    alone_a = [r[0] for r in _run(row, [target], [1234], steps)]
    alone_b = [r[0] for r in _run(row, [target], [1234], steps)]
    assert alone_a == alone_b
    assert len(set(alone_a)) > 1

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.7, seed=99),
    ]
    batch = [torch.cat([rand_logits(1, seed=500 + t), rand_logits(1, seed=600 + t), row[t], rand_logits(1, seed=700 + t)]) for t in range(steps)]
    in_batch = [r[2] for r in _run(batch, [others[0], others[1], target, others[2]], [None, None, 1234, 99], steps)]
    assert in_batch == alone_a

    other_seed = [r[0] for r in _run(row, [target], [4321], steps)]
    assert other_seed != alone_a


# ---------------------------------------------------------------- filters


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Independent float64 computation of the tokens top-k/top-p/min-p may emit."""
    x = (logits.double() / p.temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    m = max(x[i] for i in order)
    w = {i: math.exp(x[i] - m) for i in order}
    z = sum(w.values())
    probs = {i: w[i] / z for i in order}
    kept, cum = [], 0.0
    for i in order:
        kept.append(i)
        cum += probs[i]
        if cum >= p.top_p:
            break
    pmax = probs[order[0]]
    return {i for i in kept if probs[i] >= p.min_p * pmax}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.5, top_k=50, top_p=0.9),
    ],
    ids=["top_k", "top_p", "min_p", "combined", "k_over_vocab"],
)
def test_filters_stay_in_allowed_set(params):
    rows, draws = 8, 300
    logits = rand_logits(rows, seed=7)
    allowed = [allowed_set(logits[r], params) for r in range(rows)]
    assert any(len(a) > 1 for a in allowed)
    assert any(len(a) < V for a in allowed)
    big = logits.repeat(draws, 1)
    seen = [set() for _ in range(rows)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler().sample(big, [params] * len(big), [None] * len(big))
    for j, t in enumerate(out.token_ids):
        seen[j % rows].add(t)
    gens = [make_generator(r, "cpu") for r in range(rows)]
    for _ in range(50):
        for r, t in enumerate(Sampler().sample(logits, [params] * rows, gens).token_ids):
            seen[r].add(t)
    for r in range(rows):
        assert seen[r] <= allowed[r], (r, seen[r] - allowed[r])
    assert any(len(s) > 1 for s in seen)


def test_mixed_filter_params_per_row():
    logits = rand_logits(4, seed=3)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.3),
        SamplingParams(),
        SamplingParams(min_p=0.5, temperature=0.5),
    ]
    allowed = [allowed_set(logits[i], params[i]) for i in range(4)]
    assert len(allowed[2]) == V
    big = logits.repeat(200, 1)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        out = Sampler().sample(big, params * 200, [None] * len(big))
    seen = [set() for _ in range(4)]
    for j, t in enumerate(out.token_ids):
        seen[j % 4].add(t)
    for i in range(4):
        assert seen[i] <= allowed[i]
    assert len(seen[2]) > 5


# ---------------------------------------------------------------- distribution


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF4_P001 = 18.47


def test_temperature_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0])
    temp, n = 0.7, 20_000
    expected = torch.softmax(logits.double() / temp, -1)
    params = SamplingParams(temperature=temp)

    with torch.random.fork_rng():
        torch.manual_seed(2024)
        out = Sampler().sample(logits.repeat(n, 1), [params] * n, [None] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    assert _chi_square(counts, expected) < CHI2_DF4_P001

    g = make_generator(11, "cpu")
    sampler = Sampler()
    ids = [sampler.sample(logits.repeat(100, 1), [params] * 100, [g] * 100).token_ids for _ in range(n // 100)]
    counts = torch.bincount(torch.tensor(ids).flatten(), minlength=5).double()
    assert _chi_square(counts, expected) < CHI2_DF4_P001


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(6, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, top_k=3, logprobs=True),
        SamplingParams(temperature=2.0, logprobs=False),
        SamplingParams(temperature=1.0, top_p=0.7, min_p=0.1, logprobs=True),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, logprobs=True, seed=8),
    ]
    gens = [None, None, None, make_generator(3, "cpu"), None, make_generator(8, "cpu")]
    ref = torch.log_softmax(logits, -1)
    for _ in range(10):
        out = Sampler().sample(logits, params, gens)
        for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            if params[i].logprobs:
                assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)
            else:
                assert lp is None


def test_all_greedy_logprobs():
    logits = rand_logits(3, seed=9)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=True)] * 3, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-5)
