"""Methods declare what their decode steps may do (``DecodeCapabilities``); the engine no longer detects it.

Before the declaration the engine derived the same decisions from four flags and from which hooks a class
overrode (``cuda_graph_safe``, ``graph_hooks``, ``replayable(batch)``, ``max_decode_window(req)``,
``is_hookless()``, ``end_layer`` overridden or not). Those old definitions are copied here, per method class, as
the reference: for every registered method, in configurations and request states on both sides of each of
its thresholds, the declaration must give the same decisions: whether the engine captures decode graphs,
whether a pure-decode step replays them (graphs captured with the method itself, with the dense method, or
with a method whose hooks the graphs capture), how many decode steps a request may run back to back, and
whether the model hands the runner each layer's output.
"""

from types import SimpleNamespace

import pytest
import torch

from engine.contract.method import UNBOUNDED_WINDOW, DecodeCapabilities, SparseMethod
from engine.decode_speedups import reasons_against_graphs
from engine.model_runner import ModelRunner, replays_captured_graph
from engine.registry import METHODS, create_method

# --- the old rules (reference) ----------------------------------------------------------------------------
STEP_HOOKS = ("begin_step", "before_attention", "select", "after_attention", "end_layer", "end_step")
NOT_GRAPH_SAFE = {"H2O", "TOVA", "RetroInfer", "SnapKV", "RKV", "Quest", "OmniKV"}  # cuda_graph_safe = False
GRAPH_HOOKS = {"Quest", "OmniKV"}  # graph_hooks = True


def old_class(method: SparseMethod) -> str:
    """The class whose old definitions ``method`` used (its own, or the nearest base's: PyramidKV is a SnapKV)."""
    known = NOT_GRAPH_SAFE | {"StreamingLLM", "KnormEviction", "KVzip"}
    return next((c.__name__ for c in type(method).__mro__ if c.__name__ in known), "SparseMethod")


def old_cuda_graph_safe(method) -> bool:
    return old_class(method) not in NOT_GRAPH_SAFE


def old_graph_hooks(method) -> bool:
    return old_class(method) in GRAPH_HOOKS


def old_overrides_replayable(method) -> bool:
    return old_class(method) in {"SnapKV", "RKV", "Quest", "OmniKV"}


def old_is_hookless(method) -> bool:
    cls = type(method)
    return all(getattr(cls, h) is getattr(SparseMethod, h) for h in STEP_HOOKS)


def old_snapkv_done(method, req) -> bool:
    st = method._states.get(req.request_id)
    return (st is not None and st.prompt_evicted and st.preemptions == req.num_preemptions
            and not method.config.reeval_every)


def old_all_rows_decode(batch) -> bool:
    return (batch.view.is_pure_decode and not batch.finished_prompt
            and all(req.num_computed_tokens >= req.num_prompt_tokens for req in batch.requests))


def old_replayable(method, batch) -> bool:
    kind = old_class(method)
    if kind == "SnapKV":
        return all(old_snapkv_done(method, req) for req in batch.requests)
    if kind == "RKV":
        cfg, cache = method.config, batch.cache
        limit = cfg.budget + cfg.buffer
        for req in batch.requests:
            if req.num_computed_tokens < req.num_prompt_tokens:
                return False
            if limit - cache.table(req).num_slots <= cfg.alpha:
                return False
        return True
    if kind in ("Quest", "OmniKV"):
        return old_all_rows_decode(batch)
    return old_cuda_graph_safe(method)


def old_max_decode_window(method, req) -> int:
    kind, cfg = old_class(method), method.config
    if kind == "StreamingLLM":
        return max(1, cfg.sink_tokens + cfg.window + cfg.slack - method._cache.table(req).num_slots)
    if kind == "KnormEviction":
        if req.request_id in method._pending:
            return 1
        if not cfg.evict_every:
            return UNBOUNDED_WINDOW
        return max(1, cfg.evict_every - 1 - (req.num_computed_tokens - req.num_prompt_tokens) % cfg.evict_every)
    if kind == "KVzip":
        return 1 if req.request_id in method._pending else UNBOUNDED_WINDOW
    if kind == "SnapKV":
        return UNBOUNDED_WINDOW if old_snapkv_done(method, req) else 1
    if kind == "RKV":
        if req.num_computed_tokens < req.num_prompt_tokens:
            return 1
        return max(1, cfg.budget + cfg.buffer - cfg.alpha - method._cache.table(req).num_slots)
    if kind in ("Quest", "OmniKV"):
        return UNBOUNDED_WINDOW
    return UNBOUNDED_WINDOW if old_is_hookless(method) else 1


def old_captures_graphs(method) -> bool:
    return not (not old_cuda_graph_safe(method) and not old_overrides_replayable(method))


def old_replays(captured, method, part) -> bool:
    if (old_graph_hooks(method) or old_graph_hooks(captured)) and method is not captured:
        return False
    return old_replayable(method, part)


def old_wants_layer_output(method) -> bool:
    return type(method).end_layer is not SparseMethod.end_layer


# --- representative states --------------------------------------------------------------------------------
SMALL = {  # configurations with thresholds near the slot counts swept below (the defaults are swept too)
    "streaming_llm": [{"sink_tokens": 2, "window": 8, "slack": 3}],
    "snapkv": [{"budget": 16, "window": 4}, {"budget": 16, "window": 4, "reeval_every": 2}],
    "pyramidkv": [{"budget": 16, "window": 4, "reeval_every": 3}],
    "knorm": [{"evict_every": 4}, {"evict_every": 1}],
    "rkv": [{"budget": 12, "buffer": 6, "alpha": 3}],
}
SLOTS = sorted({*range(0, 40), *range(625, 646), *range(1035, 1046)})
# (prompt tokens, computed tokens): in the prompt, at its last token, decoding
PROGRESS = [(8, 0), (8, 7), (8, 8), (8, 9), (8, 10), (8, 11), (8, 20), (8, 23)]


class FakeCache:
    """What the methods' decode decisions read of a cache: the slots each request's table holds."""

    def __init__(self):
        self.slots: dict[str, int] = {}

    def table(self, req):
        return SimpleNamespace(num_slots=self.slots[req.request_id])


def configurations():
    for name in METHODS.names():
        for options in [None, *SMALL.get(name, [])]:
            yield pytest.param(name, options, id=f"{name}-{options}" if options else name)


def requests(method, cache: FakeCache, num_slots: int):
    """Requests in every state the method's decisions look at, each holding ``num_slots`` slots."""
    reqs = []
    for i, (prompt, computed) in enumerate(PROGRESS):
        for preemptions in (0, 1):
            for pending in (False, True):
                for evicted in (None, False, True):  # no per-request state / prompt not evicted / evicted
                    rid = f"r{i}-{preemptions}-{pending}-{evicted}-{num_slots}"
                    req = SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_computed_tokens=computed,
                                          num_preemptions=preemptions)
                    cache.slots[rid] = num_slots
                    if pending and isinstance(getattr(method, "_pending", None), set):
                        method._pending.add(rid)
                    if evicted is not None and isinstance(getattr(method, "_states", None), dict):
                        method._states[rid] = SimpleNamespace(prompt_evicted=evicted, preemptions=0)
                    reqs.append(req)
    return reqs


def decode_part(reqs, cache):
    """A method's rows of a pure-decode step with no prompt completing in it (where the runner asks)."""
    return SimpleNamespace(requests=reqs, view=SimpleNamespace(is_pure_decode=True), finished_prompt=[],
                           cache=cache)


# --- the tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,options", list(configurations()))
def test_declared_capabilities_decide_as_the_old_rules(name, options):
    method = create_method(name, options)
    cache = FakeCache()
    method._cache = cache  # what bind() keeps for the methods whose decisions read the cache
    dense, selecting = SparseMethod(), create_method("quest")  # graphs captured with hooks / without
    assert isinstance(method.decode, DecodeCapabilities)

    # graphs are captured at start-up (everything else allowing it) exactly when they were
    on_gpu = reasons_against_graphs(SimpleNamespace(enforce_eager=False), torch.device("cuda"),
                                    SimpleNamespace(cuda_graph_safe=True, name="b"), method, 1, SimpleNamespace(),
                                    "arch")
    assert (on_gpu == []) == old_captures_graphs(method)
    # the model hands each layer's output to the runner exactly when it did
    runner = SimpleNamespace(method=method, _batch=None)
    assert ModelRunner.wants_layer_output.fget(runner) == old_wants_layer_output(method)
    assert method.decode.graph_hooks == old_graph_hooks(method)

    checked = 0
    for num_slots in SLOTS:
        reqs = requests(method, cache, num_slots)
        for req in reqs:  # a request's window of decode steps
            assert method.decode_capabilities(req).window == old_max_decode_window(method, req), (req, num_slots)
        parts = [[r] for r in reqs] + [reqs[i:i + 3] for i in range(0, len(reqs), 3)] + [reqs]
        for part_reqs in parts:  # a step's replay, under graphs captured with each kind of method
            part = decode_part(part_reqs, cache)
            for captured in (method, dense, selecting):
                got = replays_captured_graph(captured, method, part)
                assert got == old_replays(captured, method, part), (captured.name, part_reqs, num_slots)
                checked += 1
    assert checked


def test_every_declaring_policy_is_covered():
    """The reference knows each built-in method that set or overrode the old flags."""
    old = NOT_GRAPH_SAFE | {"StreamingLLM", "KnormEviction", "KVzip"}
    for name in METHODS.names():
        cls = METHODS.get(name)
        declares = (cls.decode != SparseMethod.decode
                    or cls.decode_capabilities is not SparseMethod.decode_capabilities)
        if cls.__module__.startswith("policies."):
            assert declares == any(c.__name__ in old for c in cls.__mro__), name
