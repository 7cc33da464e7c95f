"""Programmatic dependent launch (``agentrt_kernels.triton._common``): which launches take it, and what a kernel
launched with it compiles to (sm_90a with Triton's bundled ptxas, no GPU needed)."""

import torch

from agentrt_kernels.triton import _common
from tests.kernels.sm90_compile import compiled_rows


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
