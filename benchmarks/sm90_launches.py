"""Compile, for an H100/H200 (sm_90a), every Triton launch the CPU tests make in the interpreter.

    python -m benchmarks.sm90_launches [--json out.json] [-k EXPR] [TEST_FILE ...]

Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not its compiled form, so it
accepts what the GPU compiler refuses or miscompiles: a ``tl.dot`` narrower than 16, mixed operand types,
a block shape that is not a power of two, a layout ptxas runs out of registers on. This tool runs the given
test files (default: the Triton kernel and backend tests) under the interpreter with a recorder on every
launch (kernel, argument dtypes and values, constexprs, ``num_warps`` / ``num_stages``), then compiles each
distinct launch for sm_90a with the specialisations a real launch gets (16-byte aligned pointers and
multiples of 16 marked so, unit integers folded) through Triton and its bundled ptxas, and checks what a
launch would be refused for (shared memory over the SM's 227 KiB, registers x threads over 64K). It prints
one JSON line per failure and a summary table; nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_TESTS = ("tests/kernels/test_triton_kernels.py", "tests/kernels/test_triton_selection.py",
                 "tests/kernels/test_quant_kernels.py", "tests/kernels/test_cluster_decode.py",
                 "tests/policies/test_palu.py", "tests/kernels/test_asym_encode.py", "tests/kernels/test_moe_router.py",
                 "tests/kernels/test_decode_linear.py", "tests/kernels/test_mla_decode_kernel.py",
                 "tests/kernels/test_mla_prefill_kernel.py", "tests/kernels/test_mla_backend.py",
                 "tests/kernels/test_latent_inputs.py", "tests/kernels/test_grouped_router.py",
                 "tests/kernels/test_kv_compact.py")
SM90_SHARED_BYTES = 232448  # an H100/H200 block's shared memory, opted in to the maximum
SM90_REGISTERS = 65536  # registers per SM (and per block)
_RECORD_ENV = "AGENTRT_RECORD_LAUNCHES"  # directory the recorder (loaded as a pytest plugin) writes into
_TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                    "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


# --- recording (inside the pytest run) --------------------------------------------------------------
def _describe(value):
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):  # a tensor, or triton.reinterpret's wrapper
        dtype = str(value.dtype).removeprefix("torch.")
        return {"ptr": _TORCH_TO_TRITON.get(dtype, dtype), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"repr": str(value)}  # a triton dtype or other constexpr object


def pytest_configure(config):
    out_dir = os.environ.get(_RECORD_ENV)
    if not out_dir:
        return
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = os.path.join(out_dir, f"launches-{worker}.jsonl")
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        record = {"module": self.fn.__module__, "name": self.fn.__name__,
                  "args": {k: _describe(v) for k, v in named.items()},
                  "options": {k: v for k, v in kwargs.items() if k not in self.arg_names}}
        key = json.dumps(record, sort_keys=True)
        if key not in seen:
            seen.add(key)
            with open(path, "a") as f:
                f.write(key + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def record(tests: list[str], out_dir: str, keyword: str | None) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", **{_RECORD_ENV: out_dir})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.sm90_launches", "-p", "no:cacheprovider", *tests]
    if keyword:
        cmd += ["-k", keyword]
    subprocess.run(cmd, env=env, check=False)


# --- compiling (a process without the interpreter) -------------------------------------------------
def _constexpr(desc):
    if "value" in desc:
        return desc["value"]
    if "repr" in desc:  # a triton dtype (``tl.bfloat16`` records as "bf16")
        import triton.language as tl

        return tl.dtype(desc["repr"])
    raise ValueError(f"a pointer passed as a constexpr: {desc}")


def compile_launch(rec: dict):
    """Compile one recorded launch for sm_90a and return the compiled kernel; raises what Triton or ptxas
    raises, or RuntimeError for a launch the SM could not hold."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    sig, consts, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        desc = rec["args"].get(param.name, {"value": param.default if param.has_default else None})
        if param.is_constexpr or desc.get("value", 0) is None:
            sig[param.name], consts[param.name] = "constexpr", _constexpr(desc)
        elif "ptr" in desc:
            sig[param.name] = "*" + desc["ptr"]
            if desc["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(desc.get("value"), bool):
            sig[param.name] = "i1"
        elif isinstance(desc.get("value"), int):
            v = desc["value"]
            if v == 1:  # what the JIT specialises on
                sig[param.name], consts[param.name] = "constexpr", 1
            else:
                sig[param.name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(desc.get("value"), float):
            sig[param.name] = "fp32"
        else:
            raise ValueError(f"cannot type argument {param.name}: {desc}")
    options = {k: v for k, v in rec["options"].items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    if kernel.metadata.shared > SM90_SHARED_BYTES:
        raise RuntimeError(f"out of resources: {kernel.metadata.shared} bytes of shared memory, the SM has "
                           f"{SM90_SHARED_BYTES}")
    threads = 32 * kernel.metadata.num_warps
    from benchmarks.kernel_resources import ptxas_report  # here: the recorder's process never compiles

    registers = ptxas_report(kernel.asm["ptx"])["registers"]
    if registers * threads > SM90_REGISTERS:
        raise RuntimeError(f"too many resources requested: {registers} registers x {threads} threads")
    return kernel


def compile_all(records: list[dict]) -> list[dict]:
    failures = []
    for rec in records:
        try:
            compile_launch(rec)
        except Exception as exc:  # noqa: BLE001 -- every failure is the report
            failures.append({"kernel": f"{rec['module']}.{rec['name']}", "error": f"{type(exc).__name__}: {exc}"[:2000],
                             "args": rec["args"], "options": rec["options"]})
            print(json.dumps(failures[-1]), flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS))
    parser.add_argument("-k", dest="keyword")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("run without TRITON_INTERPRET: the launches are compiled, not interpreted")
    with tempfile.TemporaryDirectory() as tmp:
        record(args.tests, tmp, args.keyword)
        lines = {line for path in glob.glob(os.path.join(tmp, "launches-*.jsonl")) for line in open(path)}
    records = [json.loads(line) for line in sorted(lines)]
    failures = compile_all(records)
    per_kernel = collections.Counter(f"{r['module']}.{r['name']}" for r in records)
    failed = collections.Counter(f["kernel"] for f in failures)
    print(f"\n{'kernel':60}{'launches':>10}{'failed':>8}")
    for name, n in sorted(per_kernel.items()):
        print(f"{name:60}{n:>10}{failed.get(name, 0):>8}")
    print(f"{'total':60}{len(records):>10}{len(failures):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches": len(records), "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
