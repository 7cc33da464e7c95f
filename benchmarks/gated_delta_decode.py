"""One gated DeltaNet layer's decode step, the engine's in-place kernels against the path they replace.

    python -m benchmarks.gated_delta_decode --json gated_delta_decode.json   # GPU: Qwen3.6-27B's linear layers
    python -m benchmarks.gated_delta_decode --tiny                           # anywhere (interpreter): a smoke run

For B requests whose conv and recurrent states sit at scattered slots of the layer's buffers (as
``engine.storage.recurrent`` keeps them), one decode token through the conv and the gated delta rule:

- **in place** (the engine's decode steps on a GPU): ``causal_conv1d_update`` and ``gated_delta_step`` of
  ``agentrt_kernels/triton/gated_delta_step.py``, the states read at their slots and written over, the gates
  computed inside;
- **gathered**: the states gathered by slot, the torch gates and conv step, fla-core's fused recurrent kernel
  (``fused_recurrent_gated_delta_rule``, where installed; else the torch reference), the new states stored back
  by slot: what decode steps ran before.

Both are replayed from CUDA graphs (as decode steps run), their outputs and final states checked against each
other; the table gives each time and the state bytes a step must move (each recurrent state read and written
once) over the copy rate measured in the run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.roofline import copy_bandwidth  # noqa: E402
from benchmarks.sweep_helpers import add_row, finish_rows, max_rel, timed  # noqa: E402

QWEN3_6_27B = dict(key_heads=16, value_heads=48, head_dim=128, conv_kernel=4)
TINY = dict(key_heads=2, value_heads=4, head_dim=16, conv_kernel=4)


def make_layer(batch: int, key_heads: int, value_heads: int, head_dim: int, conv_kernel: int, device,
               dtype=torch.bfloat16, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    conv_dim = (2 * key_heads + value_heads) * head_dim
    slots_total = 4 * batch

    def rand(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=gen) * scale).to(device, dt)

    return dict(mixed=rand(batch, conv_dim), a=rand(batch, value_heads), b=rand(batch, value_heads),
                weight=rand(conv_dim, conv_kernel, scale=0.5), A_log=rand(value_heads, scale=0.5),
                dt_bias=rand(value_heads), conv=rand(slots_total, conv_dim, conv_kernel - 1),
                recurrent=rand(slots_total, value_heads, head_dim, head_dim, scale=0.1, dt=torch.float32),
                slots=torch.randperm(slots_total, generator=gen)[:batch].to(device),
                dims=(key_heads, value_heads, head_dim))


def in_place(layer: dict) -> torch.Tensor:
    from agentrt_kernels.triton import gated_delta_step as kernels  # the kernels themselves (interpreted on a CPU)

    nk, nv, d = layer["dims"]
    batch = layer["mixed"].shape[0]
    conv_out = kernels.causal_conv1d_update(layer["mixed"], layer["weight"], layer["conv"], layer["slots"])
    q, k, v = conv_out.split([nk * d, nk * d, nv * d], dim=-1)
    return kernels.gated_delta_step(q.view(batch, nk, d), k.view(batch, nk, d), v.view(batch, nv, d), layer["a"],
                                layer["b"], layer["A_log"], layer["dt_bias"], layer["recurrent"], layer["slots"])


def gathered(layer: dict) -> torch.Tensor:
    from agentrt_kernels import ops
    from agentrt_kernels.torch_ref.gated_delta import causal_conv1d_step, gated_delta_gates

    nk, nv, d = layer["dims"]
    batch, slots = layer["mixed"].shape[0], layer["slots"]
    conv_out, conv_new = causal_conv1d_step(layer["mixed"], layer["weight"], layer["conv"][slots])
    q, k, v = conv_out.split([nk * d, nk * d, nv * d], dim=-1)
    g, beta = gated_delta_gates(layer["a"], layer["b"], layer["A_log"], layer["dt_bias"])
    out, rec_new = ops.gated_delta_decode(q.view(batch, nk, d), k.view(batch, nk, d), v.view(batch, nv, d), g,
                                          beta, layer["recurrent"][slots])
    layer["conv"][slots] = conv_new.to(layer["conv"].dtype)
    layer["recurrent"][slots] = rec_new.to(layer["recurrent"].dtype)
    return out


def run_case(batch: int, dims: dict, device, on_gpu: bool, rate: float) -> dict:
    base = make_layer(batch, **dims, device=device)
    a, b = ({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()} for _ in range(2))
    out_a, out_b = in_place(a), gathered(b)
    row = {"batch": batch, **dims, "fla": _fla_used(device),
           "out_max_rel": max_rel(out_a, out_b),
           "state_max_rel": max_rel(a["recurrent"], b["recurrent"]),
           "conv_state_equal": bool(torch.equal(a["conv"], b["conv"]))}
    state_bytes = 2 * batch * dims["value_heads"] * dims["head_dim"] ** 2 * 4  # each fp32 state read and written
    for name, fn, layer in (("in_place", in_place, a), ("gathered", gathered, b)):
        ms = 1e3 * timed(lambda: fn(layer), on_gpu)
        row[f"{name}_ms"] = ms
        row[f"{name}_state_fraction_of_copy"] = state_bytes / (ms * 1e-3) / rate
    row["gathered_over_in_place"] = row["gathered_ms"] / row["in_place_ms"]
    return row


def _fla_used(device) -> bool:
    if device.type != "cuda":
        return False
    from agentrt_kernels import fla_gated_delta

    return fla_gated_delta._fla_ops() is not None


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run through the interpreter)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda" and not args.tiny
    dims = TINY if args.tiny else QWEN3_6_27B
    batches = [2] if args.tiny else [int(b) for b in args.batches.split(",")]
    rate = copy_bandwidth(device) if on_gpu else float("nan")  # the smoke run has no roofline
    rows = []
    print(f"{'batch':>5} {'in place ms':>12} {'gathered ms':>12} {'ratio':>6} {'out rel':>8} {'state rel':>9}")
    for batch in batches:
        row = run_case(batch, dims, device, on_gpu, rate)
        add_row(args.json, rows, row)
        print(f"{batch:>5} {row['in_place_ms']:>12.4f} {row['gathered_ms']:>12.4f} "
              f"{row['gathered_over_in_place']:>6.2f} {row['out_max_rel']:>8.1e} {row['state_max_rel']:>9.1e}",
              flush=True)
    finish_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
