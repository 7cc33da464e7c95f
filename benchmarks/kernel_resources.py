"""What our decode kernels compile to on an H100/H200 (sm_90a), read on any machine, GPU or not.

    python -m benchmarks.kernel_resources [--json out.json]

Triton compiles each kernel for the target from its source, with the specialisations a real launch gets
(16-byte aligned pointers, strides divisible by 16 marked so, unit strides folded) at the Llama-3.1-8B shape
(32 q / 8 kv heads, d128, page 32); its bundled ``ptxas`` reports registers and spills and ``cuobjdump`` the
SASS, of which the instruction mix is counted. What it says, it says without running: whether the K/V loads
are pipelined through shared memory (``LDGSTS``) or synchronous (``LDG``), how many programs fit on an SM,
how many conversions (``I2F``, ``F2F``) and special-function instructions (``MUFU``) a tile costs, and how
many instructions the main loop's body holds (the SASS between the loop's backward branch and its target):
times the warps, the warp-instructions one tile of ``BLOCK_N`` slots costs, and from them an issue bound --
the KV bandwidth at which the SMs would issue nothing but that loop, one warp-instruction per scheduler and
clock (4 per SM, 132 SMs at 1.98 GHz), an upper limit no real kernel reaches. A kernel whose issue bound is
near the copy bandwidth is limited by its instructions, not by HBM. ``--block-n 32,64,128 --warps 4,8``
compiles every kernel over those tile sizes and warp counts; ``--mla`` compiles the MLA split kernels instead
(``mla_cases``) and names the main loop's most frequent opcodes and the warps the tensor-core tiles lie over.
Timings still come from the GPU
(``attention_kernels.py``, ``codec_kernels.py``); this is for deciding what to try there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from agentrt_kernels.triton import decode_attention, quant_decode
from benchmarks.sweep_helpers import save_rows

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
WATCH = ("LDGSTS", "LDG", "HMMA", "HGMMA", "I2F", "F2F", "F2FP", "MUFU", "UTMALDG")
HQ, HKV, D, PAGE, MAX_PAGES = 32, 8, 128, 32, 1040
H200_SMS, H200_CLOCK_HZ, ISSUE_PER_CLOCK = 132, 1.98e9, 4
SMEM_PER_SM = 227 * 1024


def compile_sm90(fn, args: dict, num_warps: int = 4, num_stages: int = 3, launch_pdl: bool = False) -> dict:
    """Compile ``fn`` with ``args`` (name -> pointer type like '*bf16', an int or float value, or a constexpr
    for the UPPER_CASE names; a constexpr left out takes its default) for sm_90a; registers, spills and SASS
    instruction counts."""
    sig, consts, attrs = {}, {}, {}
    defaults = {p.name: p.default for p in fn.params}
    for i, name in enumerate(fn.arg_names):
        v = args[name] if name in args or not name.isupper() else defaults[name]
        if isinstance(v, str) and v.startswith("*"):
            sig[name], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, str) and v.startswith("tensordesc<"):  # a host-side TMA descriptor
            sig[name] = v
        elif name.isupper() or v is None:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:  # Triton folds unit integer arguments into constants
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl))
    ptx = kernel.asm["ptx"]
    report = ptxas_report(ptx, sass=True)
    ops = collections.Counter(op.split(".")[0] for op in re.findall(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", report["sass"]))
    every_loop = loops(report["sass"])
    loop = max(every_loop, key=len, default=[])
    mma = re.search(r"nvidia_mma<\{[^}]*warpsPerCTA = \[([0-9, ]+)\]", kernel.asm["ttgir"])
    regs = report["registers"]
    return {"registers": regs, "spill_stores": report["spill_stores"],
            "shared_bytes": kernel.metadata.shared,
            # an SM holds 64K registers and 227 KiB of shared memory for its programs
            "programs_per_sm": min(32, 65536 // (regs * 32 * num_warps),
                                   SMEM_PER_SM // kernel.metadata.shared if kernel.metadata.shared else 32),
            "instructions": sum(ops.values()),
            "loop_instructions": len(loop), "loop_lengths": [len(body) for body in every_loop],
            **{op: ops.get(op, 0) for op in WATCH},
            # the main loop's most frequent opcodes, and how the tensor-core tiles lie over the warps
            "loop_mix": dict(collections.Counter(opcode(t) for t in loop).most_common(8)),
            "mma_warps": [int(w) for w in mma.group(1).split(",")] if mma else None,
            "launch_order": launch_order(ptx),
            # global loads issued before the wait for the previous kernel (what may not depend on it: weights)
            "loads_before_wait": ptx.split("griddepcontrol.wait")[0].count("ld.global") if "griddepcontrol.wait" in ptx
            else 0}


_LAUNCH_MARKS = {"griddepcontrol.wait": "wait", "griddepcontrol.launch_dependents": "launch_dependents"}


def launch_order(ptx: str) -> list[str]:
    """The programmatic-dependent-launch instructions of a kernel's PTX in program order, each run of one kind
    once: ["wait", "launch_dependents"] for a kernel that waits for the previous one before it lets the next in."""
    marks = [_LAUNCH_MARKS[m] for m in re.findall("|".join(re.escape(k) for k in _LAUNCH_MARKS), ptx)]
    return [m for i, m in enumerate(marks) if i == 0 or marks[i - 1] != m]


_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
            torch.int64: "*i64", torch.uint8: "*u8", torch.int8: "*i8", torch.float8_e4m3fn: "*fp8e4nv"}


@contextlib.contextmanager
def captured_launches():
    """Inside the block, launching a Triton kernel records what the launch would compile -- (kernel, args as
    ``compile_sm90`` takes them, options) -- instead of running it, so a wrapper's own choice of tiles for a
    shape can be compiled for sm_90a on any machine (its tensors may live on the CPU). Not under
    TRITON_INTERPRET=1, whose kernels are interpreter objects."""
    from triton.runtime.jit import JITFunction

    launches, run = [], JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        values = dict(zip(self.arg_names, args)) | kwargs
        for param in self.params:
            if param.name not in values:
                values[param.name] = param.default
        launches.append((self, {name: _signature_value(v) for name, v in values.items()}, options))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def _signature_value(v):
    """A launch argument as ``compile_sm90`` takes it: a tensor as its pointer type, a TMA descriptor as its
    block type, anything else as is."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(v, torch.Tensor):
        return _POINTER[v.dtype]
    if isinstance(v, TensorDescriptor):
        return f"tensordesc<{_POINTER[v.base.dtype][1:]}[{','.join(map(str, v.block_shape))}]>"
    return v


def loops(sass: str) -> list[list[str]]:
    """The loops of a cuobjdump listing in program order, each its instructions: from a predicated backward
    branch's target (a loop's test) to the branch. An unpredicated branch back is no loop: it returns from a block
    placed after the kernel's end (ptxas puts a TMA barrier's wait loop there)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addresses = [int(a, 16) for a, _ in ins]
    found = []
    for at, (_, text) in zip(addresses, ins):
        target = re.search(r"^\s*@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:
            found.append([t for a, (_, t) in zip(addresses, ins) if int(target.group(1), 16) <= a <= at])
    return found


def opcode(instruction: str) -> str:
    """A SASS instruction's opcode without its predicate and modifiers: "@!P1 HMMA.16816.F32 ..." -> "HMMA"."""
    return re.sub(r"^\s*@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def issue_bound_tb_s(loop_instructions: int, num_warps: int, tile_bytes: float) -> float:
    """KV TB/s if an H200 issued only the main loop: one tile's bytes per ``loop x warps`` warp-instructions."""
    return tile_bytes / (loop_instructions * num_warps) * ISSUE_PER_CLOCK * H200_CLOCK_HZ * H200_SMS / 1e12


def ptxas_report(ptx: str, sass: bool = False) -> dict:
    """The bundled ptxas on ``ptx`` for sm_90a: registers per thread, spill-store bytes and, with ``sass``, the
    cuobjdump listing of the cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([os.path.join(_BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        listing = (subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout if sass else None)
    return {"registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", info).group(1)), "sass": listing}


# KV bytes a slot's K and V codes take per KV head (scales and zeros left out)
SLOT_BYTES = {"dense bf16": 2 * D * 2, "fp8 (e4m3)": 2 * D, "kivi-4 (group 32)": D, "kivi-2 (group 32)": D // 2}


def cases() -> dict[str, tuple]:
    """name -> (kernel, args, launch options) at the Llama-8B decode shape, as the backends launch them."""
    base = dict(stride_qb=HQ * D, stride_qh=D, stride_btb=MAX_PAGES, stride_ob=HQ * D, stride_oh=D, scale_log2=0.1,
                GROUP=HQ // HKV, BLOCK_G=16, NUM_SPLITS=2, MIN_SPLIT=0, UPCAST=False, PRECISION="tf32")
    lens = dict(bt_ptr="*i32", lens_ptr="*i32", mid_o_ptr="*fp32", mid_lse_ptr="*fp32")
    dense = base | lens | dict(
        q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", stride_kp=PAGE * HKV * D, stride_ks=HKV * D,
        stride_kh=D, stride_vp=PAGE * HKV * D, stride_vs=HKV * D, stride_vh=D, HEAD_DIM=D, BLOCK_D=D,
        PAGE_SIZE=PAGE, BLOCK_N=64, counter_ptr="*i32", FUSED_COMBINE=False, BLOCK_S=2)
    coded = base | lens | dict(q_ptr="*bf16", out_ptr="*bf16", kc_ptr="*u8", vc_ptr="*u8", wk_ptr="*bf16",
                               wv_ptr="*bf16", qlens_ptr="*i32", wid_ptr="*i32")
    fp8 = base | lens | dict(q_ptr="*bf16", out_ptr="*bf16", kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp32",
                             vs_ptr="*fp32", s_cp=PAGE * HKV * D, s_cs=HKV * D, s_ch=D, s_sp=PAGE * HKV, s_ss=HKV,
                             s_sh=1, HEAD_DIM=D, BLOCK_D=D, PAGE_SIZE=PAGE, BLOCK_N=32, DOT_FP16=True)
    out = {"dense bf16": (decode_attention._decode_split_kernel, dense, dict(num_stages=2)),
           "fp8 (e4m3)": (quant_decode._fp8_decode_kernel, fp8, {})}
    for bits in (4, 2):
        width, group, residual = D * bits // 8, 32, 128
        out[f"kivi-{bits} (group {group})"] = (quant_decode._intn_decode_kernel, coded | dict(
            ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16",
            s_cp=PAGE * HKV * width, s_cs=HKV * width, s_ch=width, s_kp=HKV * D, s_kg=HKV * D, s_kh=D,
            s_vp=PAGE * HKV * (D // group), s_vs=HKV * (D // group), s_vh=D // group,
            s_wn=(residual + group) * HKV * D, s_wc=HKV * D, s_wh=D, HEAD_DIM=D, BITS=bits, PAGE_SIZE=PAGE,
            KGROUP=group, VGROUP=group, CAP=residual + group, HAS_WINDOW=True, BLOCK_N=32, DOT_FP16=True), {})
    return out


def mla_cases() -> dict[str, tuple]:
    """name -> (kernel, args, launch options): the MLA split kernel as ``mla_paged_decode`` launches it at
    GLM-4.7-Flash's decode (20 heads, 512 + 64 latent channels, bs8 @ 4K, 16 splits): the gather kernel on the
    engine's 16-row pages, the halves kernel gathering there and reading by TMA on 64-row pages."""
    from agentrt_kernels.triton import mla_decode

    bf = dict(dtype=torch.bfloat16)
    out = {}
    for name, page, tma in (("gather, page 16", 16, False), ("halves, page 16", 16, True),
                            ("halves by TMA, page 64", 64, True)):
        with captured_launches() as launches:
            mla_decode.mla_paged_decode(torch.zeros(8, 20, 576, **bf), torch.zeros(64, page, 1, 576, **bf),
                                        torch.zeros(8, 4096 // page, dtype=torch.int32),
                                        torch.full((8,), 4096, dtype=torch.int32), 0.07, 512, num_splits=16, tma=tma)
        out[name] = launches[0]  # the split kernel (the combine follows)
    return out


def mla_main() -> list[dict]:
    rows = []
    for name, (fn, kernel_args, options) in mla_cases().items():
        r = compile_sm90(fn, kernel_args, **options)
        block_n, warps = kernel_args["BLOCK_N"], options["num_warps"]
        r["issue_bound_tb_s"] = issue_bound_tb_s(r["loop_instructions"], warps, block_n * 576 * 2)
        rows.append({"kernel": name, "block_n": block_n, "num_warps": warps, "num_stages": options["num_stages"],
                     **r})
        print(json.dumps(rows[-1]), flush=True)
    cols = ["block_n", "num_warps", "num_stages", "registers", "spill_stores", "programs_per_sm", "loop_instructions"]
    print("\n" + f"{'kernel':24}" + "".join(f"{c[:10]:>11}" for c in cols)
          + "  loops        mma warps  main loop's opcodes")
    for r in rows:
        print(f"{r['kernel']:24}" + "".join(f"{r[c]:>11}" for c in cols) + f"  {str(r['loop_lengths']):11}"
              f"  {str(r['mma_warps']):9}  " + ", ".join(f"{k} {v}" for k, v in r["loop_mix"].items()))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--block-n",
                        help="tile sizes to compile every kernel at, e.g. 32,64,128 (default: as launched)")
    parser.add_argument("--warps", help="warp counts, e.g. 4,8 (default: as launched)")
    parser.add_argument("--mla", action="store_true",
                        help="the MLA split kernels at GLM-4.7-Flash's decode instead (mla_cases)")
    args = parser.parse_args(argv)
    if args.mla:
        save_rows(args.json, mla_main())
        return 0
    rows = []
    for name, (fn, kernel_args, options) in cases().items():
        for block_n in [int(b) for b in args.block_n.split(",")] if args.block_n else [kernel_args["BLOCK_N"]]:
            for warps in [int(w) for w in args.warps.split(",")] if args.warps else [options.get("num_warps", 4)]:
                r = compile_sm90(fn, kernel_args | {"BLOCK_N": block_n}, **(options | {"num_warps": warps}))
                r["issue_bound_tb_s"] = issue_bound_tb_s(r["loop_instructions"], warps, block_n * SLOT_BYTES[name])
                rows.append({"kernel": name, "block_n": block_n, "num_warps": warps, **r})
                print(json.dumps(rows[-1]), flush=True)
    cols = ["block_n", "num_warps", "registers", "shared_bytes", "spill_stores", "programs_per_sm", "instructions",
            "loop_instructions", *WATCH]
    print("\n" + f"{'kernel':20}" + "".join(f"{c[:10]:>11}" for c in cols) + f"{'issue TB/s':>11}")
    for r in rows:
        print(f"{r['kernel']:20}" + "".join(f"{r[c]:>11}" for c in cols) + f"{r['issue_bound_tb_s']:>11.2f}")
    save_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
