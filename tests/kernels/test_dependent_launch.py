"""Programmatic dependent launch (``agentrt_kernels.triton._common``): which launches take it, and what a kernel
launched with it compiles to (sm_90a with Triton's bundled ptxas, no GPU needed)."""

import os

import torch

if not torch.cuda.is_available():  # as the other kernel tests: this process's kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agentrt_kernels.triton import _common  # noqa: E402
from tests.kernels.sm90_compile import compiled_rows  # noqa: E402


def test_only_hopper_class_gpus_take_it_and_the_switch_turns_it_off(monkeypatch):
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    _common._pdl_capable.cache_clear()
    try:
        monkeypatch.delenv(_common.PDL_ENV, raising=False)
        assert not _common.pdl(torch.device("cpu"))
        assert _common.pdl(torch.device("cuda", 0)) and not _common.pdl(torch.device("cuda", 1))
        monkeypatch.setenv(_common.PDL_ENV, "0")
        assert not _common.pdl(torch.device("cuda", 0))
    finally:
        _common._pdl_capable.cache_clear()


_SCRIPT = """
import json, sys
from benchmarks.kernel_resources import compile_sm90
from agentrt_kernels.triton.moe import _topk_sum_kernel

rows = [compile_sm90(_topk_sum_kernel, dict(src_ptr="*bf16", out_ptr="*bf16", hidden=2048, TOP_K=5, BLOCK=1024,
                                            PDL=pdl), launch_pdl=pdl)["launch_order"]
        for pdl in json.loads(sys.argv[1])]
print(json.dumps(rows))
"""


def test_a_kernel_waits_for_the_previous_one_before_it_lets_the_next_in():
    """Wait first, then launch the dependents: at most one kernel is placed ahead of the one running. Without
    PDL the kernel holds neither instruction."""
    assert compiled_rows(_SCRIPT, [True, False]) == [["wait", "launch_dependents"], []]


_ROUTER_SCRIPT = """
import json, sys
from benchmarks.kernel_resources import compile_sm90
from agentrt_kernels.triton import grouped_router as g

rows = []
for pdl in json.loads(sys.argv[1]):
    args = dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", res_out_ptr="*bf16", normed_ptr="*bf16",
                gate_ptr="*fp32", part_ptr="*fp32", tokens=8, hidden=2048, eps=1e-6, stride_x=2048, stride_r=2048,
                stride_ro=2048, stride_n=2048, stride_g=2048, stride_pt=2048, stride_ps=64, E=64, BLOCK_T=16,
                BLOCK_E=64, BLOCK_H=g.GATE_BLOCK_H, CHUNK=256, NUM_CHUNKS=8, MAX_UNROLLED_CHUNKS=16, NORM=True,
                PDL=pdl)
    r = compile_sm90(g._gate_partials_kernel, args, num_warps=g.gate_launch(8)["num_warps"], launch_pdl=pdl)
    rows.append({k: r[k] for k in ("launch_order", "loads_before_wait", "spill_stores")})
print(json.dumps(rows))
"""


def test_the_router_loads_its_gate_slice_before_it_waits():
    """GLM-4.7-Flash's gate (64 experts, one tile) at 8 rows: the gate slice's loads are issued before the wait
    for the previous kernel (the rows after it)."""
    with_pdl, without = compiled_rows(_ROUTER_SCRIPT, [True, False])
    assert with_pdl["launch_order"] == ["wait", "launch_dependents"] and with_pdl["loads_before_wait"] > 0
    assert with_pdl["spill_stores"] == 0 and without["launch_order"] == []


def _kernels_and_launches():
    """(jit functions with a PDL parameter, launches that pass launch_pdl) across agentrt_kernels/triton."""
    import ast
    import pathlib

    root = pathlib.Path(_common.__file__).parent
    kernels, launches = {}, []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.FunctionDef) and node.name != "pdl_enter"
                    and any(a.arg == "PDL" for a in node.args.args)):
                kernels[f"{path.name}:{node.name}"] = node
            if isinstance(node, ast.Call) and any(k.arg == "launch_pdl" for k in node.keywords):
                launches.append((f"{path.name}:{node.lineno}", node))
    return kernels, launches


def _name(expr):
    """The variable a PDL / launch_pdl keyword's value names (``on``, or the target of ``(on := pdl(...))``)."""
    import ast

    if isinstance(expr, ast.NamedExpr):
        return expr.target.id
    return expr.id if isinstance(expr, ast.Name) else ast.dump(expr)


def test_every_kernel_launched_with_pdl_waits_before_it_writes():
    """A kernel launched with ``launch_pdl`` may start while the previous kernel runs, so it must wait
    (``pdl_enter(PDL)``) before it stores anything, and its launch must pass the same flag as ``PDL`` and
    ``launch_pdl``: a launch with the attribute but no wait in the kernel would race the previous kernel."""
    import ast

    kernels, launches = _kernels_and_launches()
    assert len(kernels) >= 15 and len(launches) >= 15, (len(kernels), len(launches))
    for where, call in launches:
        keywords = {k.arg: k.value for k in call.keywords}
        assert "PDL" in keywords and _name(keywords["PDL"]) == _name(keywords["launch_pdl"]), where
    writes = ("store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min")
    for name, fn in kernels.items():
        entered = False
        for stmt in fn.body:
            calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
            if any(isinstance(c.func, ast.Name) and c.func.id == "pdl_enter" for c in calls):
                entered = True
                continue
            if not entered:
                assert not any(isinstance(c.func, ast.Attribute) and c.func.attr in writes for c in calls), name
        assert entered, f"{name} takes PDL but never calls pdl_enter(PDL)"
