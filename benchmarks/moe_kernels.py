"""The fused MoE kernel at decode batch sizes against the bytes of the experts it routes to, over launch configs.

    python -m benchmarks.moe_kernels --json moe_kernels.json     # GPU: Qwen3-30B-A3B's MoE layer, T = 8, 32
    python -m benchmarks.moe_kernels --shape glm-4.7-flash --grid wide   # GLM-4.7-Flash's, a wider launch grid
    python -m benchmarks.moe_kernels --tiny                      # CPU smoke run (Triton interpreter)

One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, expert intermediate 768, bf16,
random weights) or of GLM-4.7-Flash's (64 experts, top-4, intermediate 1536, and its shared expert stacked after
the routed ones, every token's fifth choice with weight 1, as ``engine.models.deepseek_v3`` runs it), T decode
tokens routed uniformly at random (each token's experts distinct, as a top-k gives them). A decode step reads the
weights of every expert its tokens route to -- ``distinct experts x 3 x H x I`` bytes, the shared one included --
so the kernel's floor is those bytes at the copy bandwidth measured in the same run; the engine's MoE roofline
(``benchmarks.throughput --shape ...``) counts the same bytes. ``fused_moe`` runs in its default
configuration, checked against a dense per-expert torch reference, then over a grid of block sizes, warps and
pipelining stages (each checked against the default's output), every time the median of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

TINY = "--tiny" in sys.argv
if TINY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.sweep_helpers import grid, norm_rel, save_rows, time_configs, timer  # noqa: E402
from agentrt_kernels.triton.moe import _default_config, fused_moe  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768, shared=0),
          "glm-4.7-flash": dict(experts=64, top_k=4, hidden=2048, inter=1536, shared=1)}
TINY_SHAPE = dict(experts=8, top_k=2, hidden=64, inter=32, shared=1)
SWEEPS = {"default": {"BLOCK_N": (32, 64, 128), "BLOCK_K": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4)},
          # decode's one 16-row block an expert: narrower and deeper tiles, more stages in flight
          "wide": {"BLOCK_N": (16, 32, 64), "BLOCK_K": (128, 256), "num_warps": (4, 8), "num_stages": (3, 4, 5)}}
TINY_SWEEP = {"BLOCK_N": (16, 32), "BLOCK_K": (32,), "num_warps": (4,), "num_stages": (1,)}


def reference(x, w_gu, w_d, weights, ids, inter: int) -> torch.Tensor:
    """Each routed expert's SwiGLU in fp32, weighted and summed per token."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        a = x[tok].float() @ w_gu[e].float().T
        a = torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]
        out.index_add_(0, tok, (a @ w_d[e].float().T) * weights[tok, j, None].float())
    return out


def copy_bandwidth() -> float:
    import triton

    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)


def run_case(tokens: int, shape: dict, space: dict, gen, device: str, tiny: bool) -> dict:
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    dtype = torch.float32 if tiny else torch.bfloat16
    stacked = e + shape["shared"]
    w_gu = (torch.randn(stacked, 2 * inter, h, generator=gen, device=device) / h**0.5).to(dtype)
    w_d = (torch.randn(stacked, h, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    x = torch.randn(tokens, h, generator=gen, device=device).to(dtype)
    ids = torch.rand(tokens, e, generator=gen, device=device).argsort(dim=1)[:, :k]  # k distinct experts a token
    weights = torch.softmax(torch.randn(tokens, k, generator=gen, device=device), -1)
    if shape["shared"]:  # the shared expert: every token's last choice, weight 1
        ids = torch.cat([ids, torch.full((tokens, 1), e, device=device, dtype=ids.dtype)], 1)
        weights = torch.cat([weights, torch.ones(tokens, 1, device=device)], 1)
    weights = weights.to(dtype)
    distinct = ids.unique().numel()
    expert_bytes = distinct * 3 * h * inter * w_gu.element_size()
    measure = timer(tiny)

    def run(**cfg):
        return fused_moe(x, w_gu, w_d, weights, ids, config=cfg or None)

    base = run()
    err = norm_rel(base, reference(x, w_gu, w_d, weights, ids, inter))
    t_default = measure(run)
    configs = time_configs(run, grid(space), measure, expert_bytes, base, norm_rel)
    timed = [c for c in configs if "ms" in c]
    best = min(timed, key=lambda c: c["ms"]) if timed else None
    if best is not None:  # the down projection's column block alone, at the best configuration
        downs = [{**{n: best[n] for n in space}, "BLOCK_N_DOWN": bn} for bn in space["BLOCK_N"]]
        configs += time_configs(run, downs, measure, expert_bytes, base, norm_rel)
        best = min((c for c in configs if "ms" in c), key=lambda c: c["ms"])
    return {"tokens": tokens, **shape, "distinct_experts": distinct, "expert_bytes": expert_bytes,
            "default_config": _default_config(ids.numel(), stacked), "default_ms": t_default * 1e3,
            "default_tb_s": expert_bytes / t_default / 1e12, "rel_err_vs_ref": err, "best": best,
            "configs": configs}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, the interpreter")
    ap.add_argument("--tokens", default="8,32")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--grid", choices=sorted(SWEEPS), default="default", help="the launch grid swept")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, space = (TINY_SHAPE, TINY_SWEEP) if args.tiny else (SHAPES[args.shape], SWEEPS[args.grid])
    copy = None if device == "cpu" else copy_bandwidth()
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        row = run_case(t, shape, space, gen, device, args.tiny)
        if copy:
            row["copy_tb_s"] = copy / 1e12
            row["default_of_copy"] = row["default_tb_s"] * 1e12 / copy
            row["best_of_copy"] = row["best"]["tb_s"] * 1e12 / copy if row["best"] else None
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
        rows.append(row)
        save_rows(args.json, rows)
    print(f"\n{'T':>4} {'experts':>8} {'MB':>7} {'default ms':>11} {'TB/s':>6} {'best ms':>8} {'TB/s':>6}  best config")
    for r in rows:
        b = r["best"] or {}
        cfg = {k: v for k, v in b.items() if k not in ("ms", "tb_s", "rel_diff")}
        print(f"{r['tokens']:>4} {r['distinct_experts']:>8} {r['expert_bytes'] / 1e6:>7.1f} {r['default_ms']:>11.3f} "
              f"{r['default_tb_s']:>6.2f} {b.get('ms', float('nan')):>8.3f} {b.get('tb_s', float('nan')):>6.2f}  {cfg}")
    return rows


if __name__ == "__main__":
    main()
