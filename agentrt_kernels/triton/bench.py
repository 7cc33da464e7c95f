"""GPU micro-benchmarks of the Triton kernels against HBM / tensor-core ceilings.

``python -m agentrt_kernels.triton.bench [--quick] [--only decode,prefill,elementwise,moe,splits]``

Prints one table: per case the median time (triton.testing.do_bench, L2 flushed between runs; decode
through CUDA-graph replay as the engine runs it), achieved GB/s over the minimum bytes (each input read
once, each output written once) or TFLOP/s, and that as a fraction of the ceiling (the measured
device-to-device copy bandwidth; 790 TFLOP/s dense bf16 for the attention/MoE matmuls). Decode and MoE
are timed as CUDA-graph replays. Needs a GPU.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.testing

from agentrt_kernels.torch_ref import paged_attention
from agentrt_kernels.triton import (
    apply_rotary,
    fused_moe,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    silu_and_mul,
    store_kv,
    two_wave_splits,
)

DEV = "cuda"
BF16 = torch.bfloat16
MATMUL_PEAK_TFLOPS = 790.0
ROWS: list[tuple[str, float, str, str]] = []


def _bench(fn, graph: bool = False) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph runs on a fresh stream that does not wait for ours
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _row(name: str, ms: float, amount: float, unit: str, ceiling: float) -> None:
    rate = amount / (ms * 1e-3)
    if unit == "GB/s":
        rate /= 1e9
    else:
        rate /= 1e12
    ROWS.append((name, ms * 1e3, f"{rate:9.1f} {unit}", f"{100 * rate / ceiling:5.1f}%"))


def copy_bandwidth() -> float:
    n = 1 << 29  # 1 GiB of bf16
    a = torch.empty(n, dtype=BF16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    bw = 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e9
    ROWS.append(("copy 1 GiB (ceiling)", ms * 1e3, f"{bw:9.1f} GB/s", "100.0%"))
    return bw


def _paged(batch, kv_len, hkv, d, page_size, dtype=BF16):
    pages_per = math.ceil(kv_len / page_size)
    num_pages = batch * pages_per + 1
    k_cache = torch.randn(num_pages, page_size, hkv, d, device=DEV, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    bt = torch.randperm(num_pages - 1, device=DEV)[: batch * pages_per].view(batch, pages_per).int()
    return k_cache, v_cache, bt


def bench_decode(bw: float, quick: bool) -> None:
    hq, hkv, d, ps = 32, 8, 128, 16
    cases = [(1, 8192), (8, 4096), (32, 2048), (64, 1024), (128, 4096), (256, 1024)]
    if quick:
        cases = cases[:3]
    for batch, kv_len in cases:
        k_cache, v_cache, bt = _paged(batch, kv_len, hkv, d, ps)
        lens = torch.full((batch,), kv_len, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=BF16)
        out = torch.empty_like(q)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = two_wave_splits(batch, hkv, bt.shape[1] * ps, sms)
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, bt, lens, d**-0.5, out=out)  # noqa: E731
        fn()
        if batch <= 8:  # spot-check against the oracle
            ref, _ = paged_attention(q, k_cache, v_cache, bt, [kv_len] * batch, [1] * batch, d**-0.5)
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 3e-2, err
        ms = _bench(fn, graph=True)
        nbytes = 2 * batch * kv_len * hkv * d * 2 + 2 * q.numel() * 2
        _row(f"decode B={batch} L={kv_len} Hq{hq}/Hkv{hkv} splits={splits}", ms, nbytes, "GB/s", bw)


def bench_splits(bw: float) -> None:
    hq, hkv, d, ps = 32, 8, 128, 16
    for batch, kv_len in [(1, 8192), (8, 4096), (32, 2048)]:
        k_cache, v_cache, bt = _paged(batch, kv_len, hkv, d, ps)
        lens = torch.full((batch,), kv_len, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=BF16)
        out = torch.empty_like(q)
        nbytes = 2 * batch * kv_len * hkv * d * 2
        for s in (1, 2, 4, 8, 16, 32, 64):
            fn = lambda: paged_decode_attention(  # noqa: E731
                q, k_cache, v_cache, bt, lens, d**-0.5, num_splits=s, out=out)
            _row(f"  splits sweep B={batch} L={kv_len} s={s}", _bench(fn, graph=True), nbytes, "GB/s", bw)


def bench_prefill(quick: bool) -> None:
    hq, hkv, d, ps = 32, 8, 128, 16
    cases = [(1, 4096, 0), (4, 1024, 0), (2, 512, 3584), (16, 256, 0)]
    if quick:
        cases = cases[:2]
    for batch, q_len, ctx in cases:
        kv_len = q_len + ctx
        k_cache, v_cache, bt = _paged(batch, kv_len, hkv, d, ps)
        lens = torch.full((batch,), kv_len, dtype=torch.int32, device=DEV)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * q_len
        q = torch.randn(batch * q_len, hq, d, device=DEV, dtype=BF16)
        fn = lambda: paged_prefill_attention(q, k_cache, v_cache, bt, lens, qsl, d**-0.5, True, q_len)  # noqa: E731
        out = fn()
        if batch * q_len <= 2048:
            ref, _ = paged_attention(q, k_cache, v_cache, bt, [kv_len] * batch, [q_len] * batch, d**-0.5)
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 3e-2, err
        visible = batch * sum(ctx + j + 1 for j in range(q_len))
        flops = 4 * visible * d * hq
        _row(f"prefill B={batch} q={q_len} ctx={ctx} causal", _bench(fn), flops, "TFLOP/s", MATMUL_PEAK_TFLOPS)
        if ctx == 0:  # torch SDPA (flash) on contiguous KV, for scale
            qd = q.view(batch, q_len, hq, d).transpose(1, 2)
            kd = torch.randn(batch, hkv, q_len, d, device=DEV, dtype=BF16)
            vd = torch.randn_like(kd)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qd, kd, vd, is_causal=True, enable_gqa=True)
            _row("  torch SDPA same shape (dense KV)", _bench(sdpa), flops, "TFLOP/s", MATMUL_PEAK_TFLOPS)


def bench_elementwise(bw: float) -> None:
    t, h, inter, hq, hkv, d = 4096, 4096, 14336, 32, 8, 128
    x = torch.randn(t, h, device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(h, device=DEV, dtype=BF16)
    _row("rms_norm T=4096 H=4096", _bench(lambda: rms_norm(x, w, 1e-6)), 2 * x.numel() * 2, "GB/s", bw)
    _row("rms_norm+residual T=4096 H=4096", _bench(lambda: rms_norm(x, w, 1e-6, res)), 4 * x.numel() * 2,
         "GB/s", bw)
    g = torch.randn(t, 2 * inter, device=DEV, dtype=BF16)
    _row("silu_and_mul T=4096 I=14336", _bench(lambda: silu_and_mul(g)), 3 * t * inter * 2, "GB/s", bw)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=BF16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    cos = torch.randn(8192, d // 2, device=DEV, dtype=BF16)
    sin = torch.randn_like(cos)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    _row("rotary q+k T=4096 32/8x128", _bench(lambda: apply_rotary(pos, q, k, cos, sin)),
         2 * (q.numel() + k.numel()) * 2, "GB/s", bw)
    k_cache = torch.empty(t // 16 + 1, 16, hkv, d, device=DEV, dtype=BF16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(t, device=DEV)
    _row("store_kv T=4096 8x128", _bench(lambda: store_kv(k, v, k_cache, v_cache, slots)),
         4 * k.numel() * 2, "GB/s", bw)


def bench_moe(bw: float, quick: bool) -> None:
    e, topk, h, inter = 128, 8, 2048, 768  # Qwen3-30B-A3B
    w_gu = torch.randn(e, 2 * inter, h, device=DEV, dtype=BF16) / h**0.5
    w_d = torch.randn(e, h, inter, device=DEV, dtype=BF16) / inter**0.5
    for t in ([1, 64, 4096] if not quick else [64, 4096]):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        probs = torch.softmax(torch.randn(t, e, device=DEV), -1)
        tw, ti = torch.topk(probs, topk, -1)
        tw = tw.to(BF16)
        fn = lambda: fused_moe(x, w_gu, w_d, tw, ti)  # noqa: E731
        out = fn()
        ref = torch.zeros(t, h, device=DEV)
        for ex in ti.unique().tolist():
            tok, j = (ti == ex).nonzero(as_tuple=True)
            a = x[tok].float() @ w_gu[ex].float().T
            a = torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]
            ref.index_add_(0, tok, (a @ w_d[ex].float().T) * tw[tok, j, None].float())
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel
        ms = _bench(fn, graph=True)  # decode-sized MoE is launch-bound when run eagerly
        experts_hit = ti.unique().numel()
        wbytes = experts_hit * 3 * h * inter * 2
        flops = t * topk * 6 * h * inter
        if t <= 64:
            _row(f"fused_moe T={t} E={e} k={topk} H={h} I={inter} (weights)", ms, wbytes, "GB/s", bw)
        else:
            _row(f"fused_moe T={t} E={e} k={topk} H={h} I={inter}", ms, flops, "TFLOP/s", MATMUL_PEAK_TFLOPS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="decode,prefill,elementwise,moe,splits")
    args = parser.parse_args()
    only = set(args.only.split(","))
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    bw = copy_bandwidth()
    for name, run in (("decode", lambda: bench_decode(bw, args.quick)), ("splits", lambda: bench_splits(bw)),
                      ("prefill", lambda: bench_prefill(args.quick)), ("elementwise", lambda: bench_elementwise(bw)),
                      ("moe", lambda: bench_moe(bw, args.quick))):
        if name in only:
            run()
            torch.cuda.synchronize()
            print(f"[{name} done]", flush=True)
    print(f"{'case':<62} {'us':>10} {'rate':>17} {'of ceiling':>10}")
    for name, us, rate, frac in ROWS:
        print(f"{name:<62} {us:10.1f} {rate:>17} {frac:>10}")


if __name__ == "__main__":
    main()
