"""Compiling Triton kernels for an H100 / H200 (sm_90a) in the tests, on any machine: Triton's bundled ptxas does it
without a GPU. The compile runs in a child process, since kernels imported under TRITON_INTERPRET=1 (as the kernel
tests import them on a CPU) are interpreter objects that cannot be compiled."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled_rows(script: str, cases: list, timeout: int = 300) -> list[dict]:
    """Run ``script`` (which reads ``json.loads(sys.argv[1])`` and prints one JSON list as its last line) on
    ``cases`` without the interpreter; its rows. Skips where Triton's ptxas is not installed."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
