"""The DeepSeek-V3 router at a decode step's rows (GLM-4.7-Flash's 64 experts over 2048 hidden, with the
post-attention RMSNorm inside): the two-launch kernel over its launch options against the unfused path it
replaced (the norm kernel, the fp32 gate GEMM, the routing kernel).

    python -m benchmarks.router_kernels [--rows 8,32] [--json out.json]    (a GPU; --tiny: the CPU interpreter)

Each call reads a different copy of the gate (COPIES of them, more than L2 holds), as the engine's layers do;
timed as CUDA-graph replays (the decode step's graphs). Only the router's launches are timed: the MoE experts
after it are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from benchmarks.model_shapes import GLM_4_7_FLASH  # noqa: E402
from benchmarks.sweep_helpers import cycling, fastest, grid, micros, report_row, sweep_launches, timer  # noqa: E402

SPACE = {"norm_tile": [2048, 4096, 8192, 16384, 32768], "num_warps": [4, 8, 16]}
TINY_SPACE = {"norm_tile": [256, 1024], "num_warps": [4]}


def case(rows: int, experts: int, hidden: int, top_k: int, copies: int, device, space: dict, time_fn) -> dict:
    from agentrt_kernels.triton import rms_norm
    from agentrt_kernels.triton.grouped_router import (gate_launch, route_grouped_sigmoid,
                                                       route_grouped_sigmoid_from_hidden)

    bf = dict(dtype=torch.bfloat16, device=device)
    x, residual = torch.randn(rows, hidden, **bf), torch.randn(rows, hidden, **bf)
    weight, eps = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16), 1e-5
    gates = [0.05 * torch.randn(experts, hidden, device=device) for _ in range(copies)]
    bias = 0.1 * torch.randn(experts, device=device)
    args = (top_k, 1, 1, True, 1.8, torch.bfloat16, experts)

    def unfused(gate):
        normed, new_residual = rms_norm(x, weight, eps, residual)
        return route_grouped_sigmoid(F.linear(normed.float(), gate), bias, *args)

    def fused(gate, launch):
        return route_grouped_sigmoid_from_hidden(x, gate, bias, *args, norm=(weight, eps), residual=residual,
                                                 launch=launch)

    want = unfused(gates[0])[0]
    row = {"rows": rows, "experts": experts, "hidden": hidden, "copies": copies,
           "gate_bytes": experts * hidden * 4, "unfused_s": time_fn(cycling(unfused, gates)),
           "default": gate_launch(rows)}
    launches = sweep_launches(
        grid(space), lambda launch: {"same_experts": bool(torch.equal(fused(gates[0], launch)[0], want))},
        lambda launch: time_fn(cycling(lambda g: fused(g, launch), gates)))
    row.update(fastest(launches, row["default"], SPACE), launches=launches)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, wall clock (CPU smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # --tiny on a GPU: compiled kernels
    c = GLM_4_7_FLASH
    experts, hidden, top_k = c["n_routed_experts"], c["hidden_size"], c["num_experts_per_tok"]
    copies = 128  # 128 x 512 KB of gates: more than an H100's / H200's 50 / 60 MB L2
    space = SPACE
    if args.tiny:
        experts, hidden, copies, space = 16, 512, 2, TINY_SPACE
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        row = case(rows, experts, hidden, top_k, copies, device, space, timer(not on_gpu))
        report_row(args.json, out, row)
    print(f"\n{'rows':>4} {'unfused us':>10} {'default us':>10} {'best us':>8} {'best launch':>24}")
    for r in out:
        print(f"{r['rows']:>4} {1e6 * r['unfused_s']:>10.1f} {micros(r['default_s']):>10} {1e6 * r['best_s']:>8.1f} "
              f"{json.dumps(r['best_launch']):>24}")
    return out


if __name__ == "__main__":
    main()
