"""Random workloads under random memory and token budgets: every schedule yields the same greedy tokens as an
unconstrained run, every step respects its budgets, and every page comes back."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams

PAGE = 4


@st.composite
def workloads(draw):
    shared = draw(st.lists(st.integers(3, 500), min_size=0, max_size=12))
    reqs = []
    for _ in range(draw(st.integers(1, 6))):
        body = draw(st.lists(st.integers(3, 500), min_size=1, max_size=30))
        prompt = (shared + body) if draw(st.booleans()) else body
        reqs.append((prompt, draw(st.integers(1, 8))))
    return reqs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads(), st.integers(4, 40), st.integers(0, 12), st.booleans())
def test_constrained_schedules_match_unconstrained(tiny_llms, workload, token_budget, spare_pages, prefix_caching):
    roomy, model_dir = tiny_llms
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in workload]
    expected = [o.token_ids for o in roomy.generate(prompts, params)]

    biggest = max(-(-(len(p) + m) // PAGE) for p, m in workload)
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, num_pages=biggest + spare_pages,
              max_num_batched_tokens=token_budget, max_num_seqs=4, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    schedule = engine.scheduler.schedule

    def checked_schedule():
        plan = schedule()
        assert plan.num_tokens <= token_budget
        assert len(engine.scheduler.running) <= 4
        assert engine.pool.num_used <= engine.pool.num_pages
        return plan

    engine.scheduler.schedule = checked_schedule
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert all(r == 0 for r in engine.pool.ref_counts)
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
