"""Side by side, in one run: each fused path against the torch code it replaces, checked equal, then timed.

    python -m benchmarks.fused_paths [--json out.json]          # on a GPU, Llama-3.1-8B head shape
    python -m benchmarks.fused_paths --tiny                      # anywhere (interpreter on a CPU): a smoke run

Cases (32 q / 8 kv heads, d128, bf16 on a GPU):
- ``kivi-encode``: one decode step's re-encoding of each request's open key group and its values
  (B requests x 32 slots) -- the codec's torch ``encode`` + index copies vs ``agentrt_kernels/triton/asym_encode.py``;
- ``snapkv-vote``: a 32-query observation window over a request's paged context -- gathered keys and the fp32
  ``window_scores`` vs ``agentrt_kernels.dispatch.window_votes`` (key-split log-sum-exp + received attention);
- ``probe-attention``: one probe chunk (512 queries) over retained + probe KV -- the fp32 full-matrix path vs the
  backend's received attention (``reduce="max"``);
- ``rotary-store``: RoPE then the KV store (two kernels) vs ``rotary_and_store`` (one), B decode tokens.
On a GPU the paths that run inside decode graphs (the encode, RoPE + store) are replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``: no launch cost) and the ones the engine runs eagerly (votes, probes)
are launched as the engine does (``do_bench``); on a CPU (``--tiny``) one wall-clock call, which says nothing
about speed.
Prints one JSON line per case and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.sweep_helpers import timed  # noqa: E402

HQ, HKV, D = 32, 8, 128


def kivi_encode(batch: int, device, dtype) -> dict:
    from engine.contract.codec import TensorCodec
    from agentrt_kernels.triton.asym_encode import encode_channel_groups, encode_token_groups
    from policies.kivi import PerChannelKeys, PerTokenValues

    group, bits = 32, 4
    n, num_slots = batch * group, batch * group * 4
    x = torch.randn(n, HKV, D, device=device).to(dtype)
    slots = (torch.randperm(num_slots // group, device=device)[:batch, None] * group
             + torch.arange(group, device=device)).flatten()
    sides = []  # (codec, its fused kernel, torch-path fields, fused-path fields)
    for codec, kernel in ((PerChannelKeys(bits, group), encode_channel_groups),
                          (PerTokenValues(bits, group), encode_token_groups)):
        specs = codec.fields(D)
        ref, got = ({name: torch.zeros((num_slots // codec.token_group if f.per_group else num_slots, HKV, f.width),
                                       dtype=f.dtype, device=device) for name, f in specs.items()} for _ in range(2))
        sides.append((codec, kernel, ref, got))

    def torch_path():  # the codec's encode, then one index copy per field
        for codec, _, ref, _ in sides:
            TensorCodec.store(codec, x, slots, ref)

    def fused_path():
        for _, kernel, _, got in sides:
            kernel(x, slots, got["codes"], got["scale"], got["zero"], bits, group)

    def equal():
        return all(torch.equal(ref[k], got[k]) for _, _, ref, got in sides for k in ref)
    return {"torch": torch_path, "fused": fused_path, "equal": equal, "shape": f"B={batch} x {group} slots",
            "graph": True}


def snapkv_vote(context: int, device, dtype) -> dict:
    from agentrt_kernels.dispatch import window_votes
    from policies.scoring import window_scores

    w, page = 32, 16
    pages = torch.randperm(context // page + 8, device=device)[: context // page].to(torch.int32)
    k_cache = torch.randn(context // page + 8, page, HKV, D, device=device).to(dtype)
    q = torch.randn(w, HQ, D, device=device).to(dtype)
    positions = torch.arange(context, device=device)
    slots = (pages.long()[:, None] * page + torch.arange(page, device=device)).flatten()
    res = {}

    def torch_path():
        keys = k_cache.flatten(0, 1)[slots]
        res["torch"] = window_scores(q, keys, positions[-w:], positions.expand(HKV, context)) * (HQ // HKV)

    def fused_path():
        res["fused"] = window_votes(q, k_cache, pages, context, D ** -0.5, use_triton=True)

    def equal():
        return bool(torch.allclose(res["torch"], res["fused"], rtol=2e-2, atol=1e-4))
    return {"torch": torch_path, "fused": fused_path, "equal": equal, "shape": f"w={w} over {context}", "graph": False}


def probe_attention(context: int, device, dtype) -> dict:
    from engine.gpu_backends import TritonBackend
    from engine.probe import _ProbeLayerRunner

    chunk = 512 if context >= 1024 else 16  # KVzip's probe rows (PROBE_ROWS); a few in a smoke run
    keys = torch.randn(context, HKV, D, device=device).to(dtype)
    values = torch.randn(context, HKV, D, device=device).to(dtype)
    q = torch.randn(chunk, HQ, D, device=device).to(dtype)
    pk = torch.randn(chunk, HKV, D, device=device).to(dtype)
    pv = torch.randn(chunk, HKV, D, device=device).to(dtype)
    visible = torch.ones(HKV, context, dtype=torch.bool, device=device)
    runner = _ProbeLayerRunner(None, D ** -0.5, "max", 1, TritonBackend())  # on a CPU: the interpreter
    res = {}

    def torch_path():
        res["torch"] = runner._dense(q, keys, values, visible, pk, pv)[1]

    def fused_path():
        res["fused"] = runner._received(q, keys, values, pk, pv)[1]

    def equal():
        return bool(torch.allclose(res["torch"], res["fused"], rtol=2e-2, atol=1e-3))
    return {"torch": torch_path, "fused": fused_path, "equal": equal, "shape": f"{chunk} queries over {context}",
            "graph": False}


def rotary_store(batch: int, device, dtype) -> dict:
    from engine.models.layers import RotaryEmbedding
    from agentrt_kernels.triton import apply_rotary, rotary_and_store, store_kv

    page, num_pages = 16, 4 * batch + 8
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    rot = RotaryEmbedding(D, 500000.0, None, 8192).to(device)
    torch.set_default_dtype(prev)
    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, device=device).to(dtype)
    positions = torch.randint(0, 8192, (batch,), device=device)
    slots = torch.randperm(num_pages * page, device=device)[:batch]

    def fresh():  # strided q/k/v views of a packed projection, as the model hands them over
        q, k, v = qkv.clone().split([HQ * D, HKV * D, HKV * D], dim=-1)
        return q.view(batch, HQ, D), k.view(batch, HKV, D), v.view(batch, HKV, D)

    def cache():
        return [torch.zeros(num_pages, page, HKV, D, device=device, dtype=dtype) for _ in range(2)]

    def two_kernels(parts, kv):
        q, k, v = parts
        apply_rotary(positions, q, k, rot.cos_cache, rot.sin_cache)
        store_kv(k, v, kv[0], kv[1], slots)
        return q

    def one_kernel(parts, kv):
        q, k, v = parts
        return rotary_and_store(positions, q, k, v, rot.cos_cache, rot.sin_cache, kv[0], kv[1], slots)

    def equal():
        a, b = cache(), cache()
        return torch.equal(two_kernels(fresh(), a), one_kernel(fresh(), b)) and all(map(torch.equal, a, b))
    timed_parts, timed_a, timed_b = fresh(), cache(), cache()  # the timed runs rotate q over and over
    return {"torch": lambda: two_kernels(timed_parts, timed_a), "fused": lambda: one_kernel(timed_parts, timed_b),
            "equal": equal, "shape": f"B={batch} tokens", "graph": True}


def cases(tiny: bool) -> list[tuple[str, object, int]]:
    if tiny:
        return [("kivi-encode", kivi_encode, 2), ("snapkv-vote", snapkv_vote, 256),
                ("probe-attention", probe_attention, 64), ("rotary-store", rotary_store, 4)]
    return [("kivi-encode", kivi_encode, 83), ("kivi-encode", kivi_encode, 8), ("snapkv-vote", snapkv_vote, 32768),
            ("snapkv-vote", snapkv_vote, 131072), ("probe-attention", probe_attention, 4096),
            ("rotary-store", rotary_store, 1), ("rotary-store", rotary_store, 64)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small sizes; on a CPU the kernels run interpreted")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    rows = []
    for name, build, size in cases(args.tiny):
        case = build(size, device, dtype)
        case["torch"](), case["fused"]()
        row = {"case": name, "shape": case["shape"], "equal": case["equal"](),
               "timing": "graph" if case["graph"] else "eager",
               "torch_us": 1e6 * timed(case["torch"], on_gpu, case["graph"]),
               "fused_us": 1e6 * timed(case["fused"], on_gpu, case["graph"])}
        row["speedup"] = row["torch_us"] / row["fused_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'case':18}{'shape':26}{'equal':>7}{'torch us':>12}{'fused us':>12}{'speedup':>9}")
    for r in rows:
        print(f"{r['case']:18}{r['shape']:26}{str(r['equal']):>7}{r['torch_us']:>12.1f}{r['fused_us']:>12.1f}"
              f"{r['speedup']:>8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
