"""The fused decode linear (RMSNorm or SiLU-and-mul before the product, one launch) beside the engine's two
launches (our Triton RMSNorm / SiLU-and-mul, then cuBLAS through F.linear), in one run, against the copy
bandwidth measured in the same run.

    python -m benchmarks.decode_linear --json decode_linear.json     # GPU: Llama-3.1-8B's decode linears
    python -m benchmarks.decode_linear --model glm-4.7-flash --rows 8,32   # GLM-4.7-Flash's (MLA) projections
    python -m benchmarks.decode_linear --tiny                        # anywhere (interpreter on a CPU): a smoke run

Cases (bf16, M = 1 and 8 rows): the packed QKV projection (6144 x 4096) after the input norm with its residual
add, gate_up (28672 x 4096) after the post-attention norm, down (4096 x 14336) after SiLU-and-mul, and o_proj
(4096 x 4096) alone (no prologue: the plain GEMV against cuBLAS), and the LM head (128256 x 4096) after the
final norm (a fusion the engine does not make yet: is it worth making). Each path is replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``, as decode steps run) over four copies of the weights taken in turn,
so no copy stays in the 50 MB L2 between calls. The fused path runs its default launch and a grid of
launches (tile sizes, warps, which operand is the weight; for one row multiply-adds in registers, ``FMA``); each
output is checked against the two-launch path, and cuBLAS alone (the GEMV without its prologue) is timed too.
The table gives each path's time, its weight bytes over the copy rate (the roofline fraction), and the saving per
decode step (over the model's layers: Llama-3.1-8B's 32, GLM-4.7-Flash's 47; the LM head once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from benchmarks.model_shapes import GLM_4_7_FLASH  # noqa: E402
from benchmarks.sweep_helpers import (  # noqa: E402
    cycling, fastest, grid, max_rel, micros, report_row, sweep_launches, timer)

COPIES = 4
SHAPES = {  # name: (N, K, prologue)
    "qkv+norm": (6144, 4096, "norm"),
    "gate_up+norm": (28672, 4096, "norm"),
    "down+silu": (4096, 14336, "silu"),
    "o_proj": (4096, 4096, None),
    "lm_head+norm": (128256, 4096, "norm"),  # the final norm into the LM head (not wired in the engine)
}


def latent_shapes(c: dict) -> dict:
    """A latent (MLA) config's decode projections: the merged q_a / kv_a projection after the input norm, q_b
    after q_a's norm, o_proj alone, the LM head after the final norm."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return {
        "qkv_a+norm": (c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden, "norm"),
        "q_b+norm": (heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"], "norm"),
        "o_proj": (hidden, heads * c["v_head_dim"], None),
        "lm_head+norm": (c["vocab_size"], hidden, "norm"),
    }


# name: (shapes, layers)
MODELS = {"llama-3.1-8b": (SHAPES, 32),
          "glm-4.7-flash": (latent_shapes(GLM_4_7_FLASH), GLM_4_7_FLASH["num_hidden_layers"])}
TINY_SHAPES = {"qkv+norm": (96, 256, "norm"), "down+silu": (64, 128, "silu"), "o_proj": (64, 128, None)}
SPACE = [  # tl.dot over rows padded to 16 or 32 (any rows); SWAP: the weight tile as the dot's left operand
    {"BLOCK_N": [64, 128], "BLOCK_K": [128, 256], "num_warps": [4], "num_stages": [3, 4], "FMA": [False],
     "SWAP": [True]},
    {"BLOCK_N": [128], "BLOCK_K": [128, 256], "num_warps": [8], "num_stages": [3], "FMA": [False], "SWAP": [True]},
    {"BLOCK_N": [64], "BLOCK_K": [256], "num_warps": [4], "num_stages": [3], "FMA": [False], "SWAP": [False]},
    # narrow weight tiles: more programs over a few output columns (GLM-4.7-Flash's 1344-, 2048- and 5120-column
    # projections: 21 to 80 programs at 64 columns)
    {"BLOCK_N": [16, 32], "BLOCK_K": [256, 512], "num_warps": [4], "num_stages": [3, 4], "FMA": [False],
     "SWAP": [True]},
    # the reduction split among programs: 64-column (wgmma) tiles with more programs than columns allow
    {"BLOCK_N": [32, 64], "BLOCK_K": [128, 256], "num_warps": [4], "num_stages": [2, 3], "FMA": [False],
     "SWAP": [True], "SPLIT_K": [2, 4, 8]},
]
FMA_SPACE = [  # one row: products in registers
    {"BLOCK_N": [8, 16, 32], "BLOCK_K": [512, 1024], "num_warps": [4, 8], "num_stages": [3], "FMA": [True]},
    {"BLOCK_N": [16, 32], "BLOCK_K": [256, 512], "num_warps": [4], "num_stages": [2, 3], "FMA": [True],
     "SPLIT_K": [2, 4]},
]
TINY_SPACE = [{"BLOCK_N": [16, 32], "BLOCK_K": [64], "num_warps": [4], "num_stages": [2], "FMA": [False],
               "SWAP": [False, True], "SPLIT_K": [1, 2]}]
TINY_FMA_SPACE = [{"BLOCK_N": [8], "BLOCK_K": [64], "num_warps": [4], "num_stages": [2], "FMA": [True]}]


def case(name: str, n: int, k: int, prologue: str | None, rows: int, device, dtype, time_fn, space: list) -> dict:
    from agentrt_kernels.triton import rms_norm, silu_and_mul
    from agentrt_kernels.triton.decode_linear import DEFAULT_LAUNCH, decode_linear

    width = 2 * k if prologue == "silu" else k
    x = torch.randn(rows, width, device=device).to(dtype)
    residual = torch.randn(rows, k, device=device).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    weights = [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for _ in range(COPIES)]

    def unfused(w):
        if prologue == "norm":
            normed, _ = rms_norm(x, norm_w, 1e-5, residual)
            return F.linear(normed, w)
        return F.linear(silu_and_mul(x) if prologue == "silu" else x, w)

    def fused(w, launch):
        kw = {"norm": (norm_w, 1e-5), "residual": residual} if prologue == "norm" else {"silu_mul": prologue == "silu"}
        out = decode_linear(x, w, launch=launch, **kw)
        return out[0] if prologue == "norm" else out

    operand = x[:, :k].contiguous()  # cuBLAS alone: the GEMV the unfused path runs after its prologue
    want = unfused(weights[0])
    row = {"case": name, "rows": rows, "N": n, "K": k, "weight_bytes": n * k * dtype.itemsize,
           "unfused_s": time_fn(cycling(unfused, weights)),
           "cublas_s": time_fn(cycling(lambda w: F.linear(operand, w), weights))}
    launches = sweep_launches(
        [DEFAULT_LAUNCH] + [c for c in space if c != DEFAULT_LAUNCH],
        lambda launch: {"max_rel_err": max_rel(fused(weights[0], launch), want)},
        lambda launch: time_fn(cycling(lambda w: fused(w, launch), weights)))
    row.update(fastest(launches, DEFAULT_LAUNCH, DEFAULT_LAUNCH), launches=launches,
               max_rel_err=max(c["max_rel_err"] for c in launches if "s" in c))
    return row


TABLE_KEYS = ("case", "rows", "N", "K", "best_launch", "best_s", "unfused_s", "cublas_s")


def write_table(rows: list[dict], gpu_name: str, measured: str) -> Path:
    """Merge the sweep's rows (their winners and times, what ``load_tuned_launches`` reads) into the GPU's tuned
    table: a row replaces the table's row of the same shape and row count."""
    from agentrt_kernels.triton.decode_linear import tuned_table_path

    path = tuned_table_path(gpu_name)
    new = [{**{k: r[k] for k in TABLE_KEYS}, "measured": measured} for r in rows]
    keys = {(r["N"], r["K"], r["rows"]) for r in new}
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([r for r in old if (r["N"], r["K"], r["rows"]) not in keys] + new, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a small grid, wall clock (CPU smoke run)")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS),
                    help="whose decode linears (and how many layers the saving a step counts)")
    ap.add_argument("--shapes", help="comma-separated case names (default: every shape of the model)")
    ap.add_argument("--json")
    ap.add_argument("--write-table", metavar="MEASURED",
                    help="write each shape's winner into this GPU's tuned table (agentrt_kernels/triton/tuned), "
                         "over its entries for the same shape and rows, noting MEASURED (date, command, commit)")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # --tiny on a GPU: compiled kernels
    dtype = torch.bfloat16 if on_gpu else torch.float32
    copy_bw = None
    if on_gpu:
        from benchmarks.roofline import copy_bandwidth

        copy_bw = copy_bandwidth(device)
    model_shapes, layers = MODELS[args.model]
    shapes, space = (TINY_SHAPES, (TINY_SPACE, TINY_FMA_SPACE)) if args.tiny else (model_shapes, (SPACE, FMA_SPACE))
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            ap.error(f"--shapes: no case {sorted(unknown)} (cases: {sorted(shapes)})")
        shapes = {name: shape for name, shape in shapes.items() if name in args.shapes.split(",")}
    rows_out = []
    for name, (n, k, prologue) in shapes.items():  # each shape's rows together: a cut run keeps whole shapes
        for rows in (int(r) for r in args.rows.split(",")):
            # one row: the multiply-adds in registers (the dots measured slower there on the H200, 2026-12-04);
            # more: the dots
            launches = [c for part in (space[1] if rows == 1 else space[0]) for c in grid(part)]
            row = case(name, n, k, prologue, rows, device, dtype, timer(not on_gpu), launches)
            row["copy_bw"] = copy_bw
            if copy_bw:
                for path in ("unfused", "cublas", "default", "best"):
                    if row[f"{path}_s"]:
                        row[f"{path}_roofline"] = row["weight_bytes"] / copy_bw / row[f"{path}_s"]
            report_row(args.json, rows_out, row)
    if args.write_table and on_gpu:
        write_table(rows_out, torch.cuda.get_device_name(device), args.write_table)
    print(f"\n{'case':>13} {'M':>3} {'unfused us':>11} {'cuBLAS us':>10} {'fused us':>9} {'best us':>8} "
          f"{'best launch':>26} {'roofline u/c/f':>15} {'saved us/step':>13}")
    for r in rows_out:
        best, unf = 1e6 * r["best_s"], 1e6 * r["unfused_s"]
        default = micros(r["default_s"])
        launch = "/".join(str(v) for v in r["best_launch"].values())
        roof = (f"{r['unfused_roofline']:.2f}/{r['cublas_roofline']:.2f}/{r['best_roofline']:.2f}"
                if r.get("unfused_roofline") else "-")
        print(f"{r['case']:>13} {r['rows']:>3} {unf:>11.1f} {1e6 * r['cublas_s']:>10.1f} {default:>9} {best:>8.1f} "
              f"{launch:>26} {roof:>15} "
              f"{(1 if r['case'].startswith('lm_head') else layers) * (unf - best):>13.1f}")


if __name__ == "__main__":
    main()
