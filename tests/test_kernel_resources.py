"""The decode kernels as compiled for sm_90a (no GPU needed): the properties the quantized kernels were
rewritten for stay true — no spills, K/V tiles pipelined through shared memory, no per-element int-to-float
conversion or special-function decode of codes. Compiled in a child process: kernels imported under
TRITON_INTERPRET=1 (as other test modules set it) are interpreter objects that cannot be compiled."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
    pytest.skip("triton's bundled ptxas is not installed", allow_module_level=True)


def test_decode_kernels_compile_pipelined_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--json", str(out)], env=env, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, timeout=300)
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense bf16", "fp8 (e4m3)", "kivi-4 (group 32)", "kivi-2 (group 32)"}
    for r in rows.values():
        assert r["spill_stores"] == 0 and r["LDGSTS"] > 0 and r["programs_per_sm"] >= 3, r
        assert r["I2F"] == 0 and r["MUFU"] <= 16, r
