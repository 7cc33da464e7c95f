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
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   capture_output=True, timeout=300)
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense bf16", "fp8 (e4m3)", "kivi-4 (group 32)", "kivi-2 (group 32)"}
    for r in rows.values():
        assert r["spill_stores"] == 0 and r["LDGSTS"] > 0 and r["programs_per_sm"] >= 3, r
        assert r["I2F"] == 0 and r["MUFU"] <= 16, r
        # the main loop found in the SASS: part of the kernel, holding the tile's tensor-core dots
        assert r["HMMA"] <= r["loop_instructions"] < r["instructions"], r
        assert r["issue_bound_tb_s"] > 0, r


def test_interpreter_launches_compile_for_sm90_and_refusals_are_reported(tmp_path):
    """``benchmarks.sm90_launches`` records the launches a test makes in the interpreter and compiles each for
    sm_90a; a launch the compiler refuses (a non-power-of-two block) or the SM could not hold (shared memory
    over 227 KiB) is reported, not passed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.sm90_launches", "tests/kernels/test_triton_kernels.py",
                           "-k", "silu", "--json", str(out)], env=env, cwd=root, capture_output=True, text=True,
                           timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["launches"] >= 2 and report["failures"] == []
    script = """
import json
from benchmarks.sm90_launches import compile_launch
ptr = {"ptr": "fp32", "aligned": True}
base = {"mid_o_ptr": ptr, "mid_lse_ptr": ptr, "out_ptr": ptr, "stride_ob": {"value": 4096},
        "stride_oh": {"value": 128}, "HEAD_DIM": {"value": 128}, "BLOCK_D": {"value": 128},
        "NUM_SPLITS": {"value": 8}, "BLOCK_S": {"value": 8}}
rec = {"module": "agentrt_kernels.triton.decode_attention", "name": "_decode_combine_kernel", "options": {"num_warps": 4}}
compile_launch(dict(rec, args=base))
from benchmarks.kernel_resources import cases
fn, args, _ = cases()["dense bf16"]
split = {k: {"ptr": v[1:], "aligned": True} if isinstance(v, str) and v.startswith("*") else {"value": v}
         for k, v in args.items()}
compile_launch({"module": fn.fn.__module__, "name": fn.fn.__name__, "args": split, "options": {"num_stages": 2}})
for bad in (dict(rec, args=base | {"BLOCK_D": {"value": 96}}),  # tl.arange needs a power of two
            {"module": fn.fn.__module__, "name": fn.fn.__name__, "options": {"num_stages": 4},
             "args": split | {"BLOCK_N": {"value": 1024}}}):  # K and V tiles of 1024 x 128, 4 stages deep
    try:
        compile_launch(bad)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, str(exc)[:80].replace(chr(10), " "))
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("REFUSED") == 2, done.stdout
    assert "out of resources" in done.stdout, done.stdout


def test_the_fused_encode_compiles_to_ieee_division_without_fma():
    """The KIVI encode is bit-exact to torch only if the GPU divides as IEEE does (``div.rn``; Triton's ``/``
    on fp32 compiles to the approximate ``div.full``) and rounds ``scale * levels + zero`` twice (no FMA)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = r"""
import re
from benchmarks.sm90_launches import compile_launch
values = dict(stride_xn=1024, stride_xh=128, stride_cn=512, stride_ch=64, stride_sn=1024, stride_sh=128, HEAD_DIM=128,
              BITS=4, GROUP=32, num_tokens=100, CHANNEL_GROUP=32, BLOCK_T=16)
ptrs = dict(x_ptr="bf16", slots_ptr="i64", codes_ptr="u8", scale_ptr="fp16", zero_ptr="fp16")
args = {k: {"value": v} for k, v in values.items()} | {k: {"ptr": t, "aligned": True} for k, t in ptrs.items()}
for name in ("_channel_groups_kernel", "_token_groups_kernel"):
    k = compile_launch({"module": "agentrt_kernels.triton.asym_encode", "name": name, "args": args,
                        "options": {"num_warps": 4, "enable_fp_fusion": False}})
    print(name, sorted(set(re.findall(r"(div\.[a-z0-9.]+|fma\.[a-z0-9.]+)", k.asm["ptx"]))))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines == ["_channel_groups_kernel ['div.rn.f32']", "_token_groups_kernel ['div.rn.f32']"], lines


def test_the_main_loop_is_the_longest_predicated_branch_back():
    """A loop closes with a predicated branch back to its head; an unpredicated branch back returns from a block
    placed after the kernel's end (a TMA barrier's wait loop) and spans no loop."""
    from benchmarks.kernel_resources import loops

    body = [(0x00, "S2R R0, SR_TID.X"), (0x10, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
            (0x20, "FMUL R1, R1, R2"), (0x30, "@!P1 BRA 0x10"), (0x40, "EXIT"),
            (0x50, "SYNCS.PHASECHK.TRANS64 P1, [UR4], R3"), (0x60, "@!P1 BRA 0x50"), (0x70, "BRA 0x20")]
    sass = "\n".join(f"        /*{a:04x}*/                   {text} ;" for a, text in body)
    found = [len(body) for body in loops(sass)]
    assert max(found) == 3 and found == [3, 2]  # 0x10..0x30 and the wait 0x50..0x60, not 0x20..0x70


def test_the_mla_split_kernels_compile_with_their_loops_counted(tmp_path):
    """``--mla``: the MLA split kernels as ``mla_paged_decode`` launches them at GLM-4.7-Flash's decode shape,
    their loops counted: the halves kernel on 64-row pages has two (whole tiles by TMA, then the partial last tile
    gathered), the TMA one shorter than the gather kernel's loop, which spends its instructions on addresses."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "mla.json"
    subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--mla", "--json", str(out)], env=env,
                   check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   capture_output=True, timeout=300)
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    gather, tma = rows["gather, page 16"], rows["halves by TMA, page 64"]
    assert set(rows) == {"gather, page 16", "halves, page 16", "halves by TMA, page 64"}
    for r in rows.values():
        assert r["spill_stores"] == 0 and r["loop_mix"]["HMMA"] > 0 and len(r["mma_warps"]) == 2, r
    assert tma["UTMALDG"] > 0 and gather["UTMALDG"] == 0
    whole_tiles = tma["loop_lengths"][0]
    assert whole_tiles < gather["loop_instructions"] and gather["loop_mix"]["IMAD"] > gather["loop_mix"]["HMMA"]
