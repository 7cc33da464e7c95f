"""An absorbed MLA layer's two per-head products at a decode step's rows (GLM-4.7-Flash: 20 heads; the query's
192 nope channels through W_UK to the 512-channel latent, the latent output through W_UV to 256 channels):
``head_matmul`` over its launch grid against torch.bmm over the heads (cuBLAS), which it replaces.

    python -m benchmarks.head_matmul [--rows 1,8,16] [--json out.json]    (a GPU; --tiny: the CPU interpreter)

Each call reads another layer's weights (COPIES of the packed kv_b weight, more than L2 holds), as decode
steps do; CUDA-graph replays. Only the product is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.model_shapes import GLM_4_7_FLASH  # noqa: E402
from benchmarks.sweep_helpers import (  # noqa: E402
    cycling, fastest, grid, max_rel, micros, report_row, sweep_launches, timer)

SPACE = {"block_n": [32, 64, 128], "block_k": [32, 64, 128], "num_warps": [4], "num_stages": [2, 3, 4]}
TINY_SPACE = {"block_n": [16, 32], "block_k": [16], "num_warps": [4], "num_stages": [2]}
DEFAULT = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}


def case(name: str, rows: int, heads: int, nope: int, rank: int, v: int, copies: int, device, dtype, space: dict,
         time_fn) -> dict:
    from agentrt_kernels.triton.head_matmul import head_matmul

    packed = [(torch.randn(heads, nope + v, rank, device=device) / rank**0.5).to(dtype) for _ in range(copies)]
    if name == "w_uk":  # q_nope [T, H, nope] (a view of the q projection) through W_UK [H, nope, rank]
        x = torch.randn(rows, heads, nope + 64, device=device).to(dtype)[..., :nope]
        weights = [w[:, :nope] for w in packed]
    else:  # the latent output [T, H, rank] through W_UV^T [H, rank, v]
        x = torch.randn(rows, heads, rank, device=device).to(dtype)
        weights = [w[:, nope:].transpose(1, 2) for w in packed]

    def bmm(w):
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    want = bmm(weights[0])
    row = {"case": name, "rows": rows, "weight_bytes": weights[0].numel() * weights[0].element_size(),
           "bmm_s": time_fn(cycling(bmm, weights))}
    launches = sweep_launches(
        grid(space), lambda launch: {"max_rel_err": max_rel(head_matmul(x, weights[0], **launch), want)},
        lambda launch: time_fn(cycling(lambda w: head_matmul(x, w, **launch), weights)))
    row.update(fastest(launches, DEFAULT, DEFAULT), launches=launches,
               max_rel_err=max(c["max_rel_err"] for c in launches if "s" in c))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, wall clock (CPU smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    c = GLM_4_7_FLASH
    heads, nope, rank, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["kv_lora_rank"], c["v_head_dim"]
    copies, space = 8, SPACE  # 8 x 9.2 MB of kv_b weights: more than L2 holds
    if args.tiny:
        heads, nope, rank, v, copies, space = 2, 24, 32, 16, 2, TINY_SPACE
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in ("w_uk", "w_uv"):
            row = case(name, rows, heads, nope, rank, v, copies, device, dtype, space, timer(not on_gpu))
            report_row(args.json, out, row)
    print(f"\n{'case':>5} {'rows':>4} {'bmm us':>7} {'default us':>10} {'best us':>8} {'best launch':>40}")
    for r in out:
        print(f"{r['case']:>5} {r['rows']:>4} {micros(r['bmm_s']):>7} {micros(r['default_s']):>10} "
              f"{micros(r['best_s']):>8} {json.dumps(r['best_launch']):>40}")
    return out


if __name__ == "__main__":
    main()
