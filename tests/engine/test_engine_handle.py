"""LLMEngine is an EngineHandle (engine.engine_handle), the structural type the server holds its engine as.

Nothing makes LLMEngine name the protocol, so these tests keep the two in step: every member the protocol lists
exists on LLMEngine with the same parameters (names, kinds, defaults) and the same types, and a live engine
passes the runtime check. A chain turn's resume status is the engine's ResumeStatus member, which still equals
its plain string."""

import ast
import importlib
import inspect
import random
import typing

import pytest

from engine import LLM, SamplingParams, engine_handle
from engine.chain_index import ResumeStatus
from engine.engine_handle import EngineHandle
from engine.llm_engine import LLMEngine
from tests.chain_helpers import random_tokens, run_chain_turn


def _annotation_names() -> dict[str, object]:
    """The names engine.engine_handle imports (some for its annotations only), imported here."""
    names: dict[str, object] = {}
    for node in ast.walk(ast.parse(inspect.getsource(engine_handle))):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _members() -> tuple[list[str], list[str]]:
    """(methods, read-only attributes) of the protocol."""
    own = {name: value for name, value in vars(EngineHandle).items() if not name.startswith("_")}
    methods = sorted(name for name, value in own.items() if inspect.isfunction(value))
    attributes = sorted(name for name, value in own.items() if isinstance(value, property))
    attributes += sorted(getattr(EngineHandle, "__annotations__", {}))
    assert set(methods) | set(attributes) >= set(own), "a protocol member that is neither method nor attribute"
    return methods, attributes


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    """An engine of its own: the chain turn below must not leave KV in an engine other tests count pages of."""
    return LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=4).engine


def test_the_protocol_lists_what_the_server_uses():
    methods, attributes = _members()
    assert methods == sorted(["add_request", "step", "abort", "has_unfinished", "retain_method",
                              "release_method", "chain_info", "delete_chain", "fork_chain", "rewind_chain",
                              "prune_chain", "pin_chain", "chain_hints", "release_chain", "prefetch_chain", "adopt_chain"])
    assert attributes == sorted(["config", "model_config", "method", "max_model_len", "pool", "last_step"])


@pytest.mark.parametrize("name", _members()[0])
def test_llm_engine_has_each_method_with_the_same_signature(name):
    theirs = getattr(LLMEngine, name, None)
    assert callable(theirs), f"LLMEngine has no method {name}"
    ours_sig, theirs_sig = inspect.signature(getattr(EngineHandle, name)), inspect.signature(theirs)
    assert [(p.name, p.kind, p.default) for p in ours_sig.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs_sig.parameters.values()]
    ours_hints = typing.get_type_hints(getattr(EngineHandle, name), localns=_annotation_names())
    assert ours_hints == typing.get_type_hints(theirs)


def test_a_live_llm_engine_is_an_engine_handle(engine):
    handle: EngineHandle = engine  # the static check; the runtime one below covers attributes set in __init__
    assert isinstance(handle, EngineHandle)
    names = _annotation_names()
    for name in _members()[1]:
        hint = typing.get_type_hints(getattr(EngineHandle, name).fget, localns=names)["return"]
        assert isinstance(getattr(engine, name), hint), f"LLMEngine.{name} is not a {hint}"


def test_a_chain_turn_reports_its_resume_status_as_the_enum_member(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = random_tokens(random.Random(0), 12)
    first = run_chain_turn(engine, "handle-chain", prompt, params)
    second = run_chain_turn(engine, "handle-chain", prompt + first.token_ids + [7, 8], params)
    engine.delete_chain("handle-chain")
    assert first.resume_status is ResumeStatus.CREATED and first.resume_status == "created"
    assert second.resume_status is ResumeStatus.RESUMED and second.resume_status == "resumed"
