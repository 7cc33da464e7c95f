"""agentrt_kernels.triton.decode_linear (RMSNorm / SiLU-and-mul fused before a decode-size linear) vs the
unfused torch ops the engine runs (engine.models.layers: RMSNorm, silu_and_mul; F.linear), on fresh random
inputs.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported)
at small sizes. fp32: the product agrees to fp32 rounding; fp16 (and bf16 on a GPU): the residual sum is
bit-equal and the output agrees to what a different fp32 summation order and one rounding allow.
"""

import os
import zlib

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from agentrt_kernels.triton.decode_linear import decode_linear  # noqa: E402
from engine.models.layers import RMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(got, want, dtype):
    """The interpreter truncates fp32 -> bf16 instead of rounding: there bf16 is checked by its relative error
    norm (and compiled for sm_90a by benchmarks.sm90_launches); on a GPU element by element."""
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2  # two truncations
    else:
        torch.testing.assert_close(got, want, **TOL[dtype])


def _seed(*key) -> None:
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _torch_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[1], eps).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    return norm._norm(x) if residual is None else (norm._norm(x + residual), x + residual)


def _torch_silu_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,fma,swap", [
    (1, 96, 160, False, False), (1, 96, 160, True, False), (5, 64, 384, False, False), (16, 40, 256, False, True),
    (5, 64, 384, False, True), (27, 40, 256, False, True), (32, 48, 128, False, False)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_then_linear(dtype, rows, n, k, fma, swap, residual, bias):
    _seed("norm", dtype, rows, n, k, residual, bias)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    res = torch.randn(rows, k, device=DEVICE).to(dtype) if residual else None
    norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    got = decode_linear(x, w, b, norm=(norm_w, 1e-6), residual=res,
                        launch={"BLOCK_N": 32, "BLOCK_K": 64, "FMA": fma, "SWAP": swap})
    if residual:
        normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
        got, got_res = got
        if dtype == torch.bfloat16 and DEVICE.type != "cuda":
            torch.testing.assert_close(got_res, want_res, rtol=8e-3, atol=8e-3)  # one bf16 ulp
        else:
            assert torch.equal(got_res, want_res)
        assert got_res.data_ptr() != res.data_ptr()
    else:
        normed = _torch_norm(x, norm_w, 1e-6)
    want = F.linear(normed.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_normed_rows_come_back_too(dtype):
    """``return_normed``: the operand every column read, as the torch norm computes it (a MoE block's experts
    read it after the router's product)."""
    _seed("normed", dtype)
    rows, n, k = 6, 20, 192  # N below one block: the one program writes every normed row
    x, res = (torch.randn(rows, k, device=DEVICE).to(dtype) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    got, got_res, got_normed = decode_linear(x, w, norm=(norm_w, 1e-6), residual=res, return_normed=True,
                                             launch={"BLOCK_N": 16, "BLOCK_K": 64})
    normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        torch.testing.assert_close(got_normed, normed, rtol=2e-2, atol=2e-2)  # two truncations, ~2 bf16 ulp
    elif dtype == torch.float32 and DEVICE.type == "cuda":  # another sum order and the GPU's rsqrt
        torch.testing.assert_close(got_normed, normed, rtol=1e-5, atol=1e-6)
        assert torch.equal(got_res, want_res)
    else:
        assert torch.equal(got_normed, normed) and torch.equal(got_res, want_res)
    assert_close(got, F.linear(normed.float(), w.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,fma,swap", [
    (1, 64, 200, False, False), (1, 64, 200, True, False), (8, 48, 128, False, False), (8, 48, 448, False, True),
    (20, 48, 192, False, True)])
def test_silu_and_mul_then_linear(dtype, rows, n, k, fma, swap):
    _seed("silu", dtype, rows, n, k)
    x = (2 * torch.randn(rows, 2 * k, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    got = decode_linear(x, w, silu_mul=True,
                        launch={"BLOCK_N": 16, "BLOCK_K": 64, "FMA": fma, "SWAP": swap})
    want = F.linear(_torch_silu_mul(x).float(), w.float()).to(dtype)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,split_k,fma,swap", [
    (8, 40, 448, 3, False, True),  # K = 7 steps of 64: splits of 3, 3 and 1 steps
    (5, 64, 384, 2, False, False), (1, 24, 320, 4, True, False), (16, 96, 256, 4, False, True),
    (32, 40, 256, 2, False, True)])
@pytest.mark.parametrize("prologue", ["norm+residual+bias", "silu", "norm+normed"])
def test_split_k_launches_equal_the_unfused_ops(dtype, rows, n, k, split_k, fma, swap, prologue):
    """``SPLIT_K``: each column tile's reduction in several programs; the last to arrive adds the partial sums
    (and the norm's sums of squares) and writes y, the residual and the normed rows as one program would. Two
    launches in a row: the arrival counters are back at zero after each."""
    from agentrt_kernels.triton import _common

    _seed("split", dtype, rows, n, k, split_k, prologue)
    launch = {"BLOCK_N": 16, "BLOCK_K": 64, "FMA": fma, "SWAP": swap, "SPLIT_K": split_k}
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    for _ in range(2):
        if prologue == "silu":
            x = (2 * torch.randn(rows, 2 * k, device=DEVICE)).to(dtype)
            assert_close(decode_linear(x, w, silu_mul=True, launch=launch),
                         F.linear(_torch_silu_mul(x).float(), w.float()).to(dtype), dtype)
            continue
        x, res = (torch.randn(rows, k, device=DEVICE).to(dtype) for _ in range(2))
        norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
        b = torch.randn(n, device=DEVICE).to(dtype) if prologue.endswith("bias") else None
        normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
        got, got_res, *got_normed = decode_linear(x, w, b, norm=(norm_w, 1e-6), residual=res, launch=launch,
                                                  return_normed=prologue.endswith("normed"))
        if dtype == torch.bfloat16 and DEVICE.type != "cuda":
            torch.testing.assert_close(got_res, want_res, rtol=8e-3, atol=8e-3)
        else:
            assert torch.equal(got_res, want_res)
        for g in got_normed:
            assert_close(g, normed, dtype)
        want = F.linear(normed.float(), w.float(), None if b is None else b.float()).to(dtype)
        assert_close(got, want, dtype)
    counts = _common._COUNTERS[(w.device, torch.cuda.current_stream().cuda_stream if DEVICE.type == "cuda" else 0)]
    assert all(int(c.abs().sum()) == 0 for c in counts)


def test_a_split_launch_sums_its_splits_in_one_order():
    """Whichever split arrives last, the partial sums are added in split order: the same bits on every run, and
    the same as the sums of the splits' products taken one split at a time."""
    _seed("split-order")
    x, w = torch.randn(4, 512, device=DEVICE), torch.randn(32, 512, device=DEVICE) / 22
    launch = {"BLOCK_N": 16, "BLOCK_K": 64, "SWAP": True, "SPLIT_K": 4}
    got = decode_linear(x, w, launch=launch)
    assert torch.equal(got, decode_linear(x, w, launch=launch))
    one = {**launch, "SPLIT_K": 1}
    want = sum(decode_linear(x[:, i:i + 128].contiguous(), w[:, i:i + 128].contiguous(), launch=one)
               for i in range(0, 512, 128))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_normed_rows_and_residual_of_the_two_pass_norm_are_the_torch_ones():
    """return_normed keeps the two-pass norm: the rows it hands on are RMSNorm's, exactly as torch computes them."""
    _seed("normed-two-pass")
    rows, n, k = 4, 40, 384
    x, res = torch.randn(rows, k, device=DEVICE), torch.randn(rows, k, device=DEVICE)
    norm_w = 1 + 0.1 * torch.randn(k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    got, got_res, got_normed = decode_linear(x, w, norm=(norm_w, 1e-6), residual=res, return_normed=True,
                                             launch={"BLOCK_N": 16, "BLOCK_K": 64, "SWAP": True})
    normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
    torch.testing.assert_close(got_normed, normed, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, F.linear(normed, w), **TOL[torch.float32])


def test_plain_linear_and_the_default_launch():
    _seed("plain")
    x, w = torch.randn(3, 512, device=DEVICE), torch.randn(70, 512, device=DEVICE) / 20
    torch.testing.assert_close(decode_linear(x, w), F.linear(x, w), **TOL[torch.float32])


def test_bad_arguments_are_refused():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most 32 rows"):
        decode_linear(torch.randn(33, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="exclusive"):
        decode_linear(x, w, norm=(torch.ones(8, device=DEVICE), 1e-6), silu_mul=True)
    with pytest.raises(ValueError, match="residual and return_normed need norm"):
        decode_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="residual and return_normed need norm"):
        decode_linear(x, w, return_normed=True)
    with pytest.raises(ValueError, match="does not match weight"):
        decode_linear(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="norm weight"):
        decode_linear(x, w, norm=(torch.ones(7, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="contiguous"):
        decode_linear(torch.randn(8, 2, device=DEVICE).t(), w)


def test_tuned_launches_are_taken_by_shape_and_rows(monkeypatch):
    """The sweep's rows become each shape's launch: the fewest measured rows >= the call's, else the most, of the
    rows on the call's side of 16 (a 16- or a 32-row tile); other shapes keep the default."""
    from agentrt_kernels.triton import decode_linear as module

    monkeypatch.setattr(module, "TUNED_LAUNCHES", {})
    one = {"BLOCK_N": 8, "BLOCK_K": 64, "FMA": True, "SWAP": False, "num_warps": 4, "num_stages": 2}
    eight = {"BLOCK_N": 16, "BLOCK_K": 128, "FMA": False, "SWAP": True, "num_warps": 4, "num_stages": 3}
    module.load_tuned_launches([{"N": 40, "K": 256, "rows": 1, "best_launch": one},
                                {"N": 40, "K": 256, "rows": 8, "best_launch": eight}])
    assert module.tuned_launch(40, 256, 1) == one
    assert module.tuned_launch(40, 256, 5) == eight and module.tuned_launch(40, 256, 16) == eight
    # past 16 rows (a 32-row tile) only rows measured past 16: none here, so the default; then the 24-row one
    assert module.tuned_launch(40, 256, 17, torch.device("cuda")) is module.UNFUSED
    assert module.tuned_launch(40, 256, 32) == module.DEFAULT_LAUNCH
    module.load_tuned_launches([{"N": 40, "K": 256, "rows": 24, "best_launch": one}])
    assert module.tuned_launch(40, 256, 32) == one and module.tuned_launch(40, 256, 16) == eight
    # a shape not measured: one row the multiply-adds launch; more rows cuBLAS on a GPU (the kernel elsewhere)
    assert module.tuned_launch(40, 512, 1) == module.ONE_ROW_LAUNCH
    assert module.tuned_launch(40, 512, 4, torch.device("cuda")) is module.UNFUSED
    assert module.tuned_launch(40, 512, 4) == module.DEFAULT_LAUNCH
    _seed("tuned")
    x, w = torch.randn(1, 256, device=DEVICE), torch.randn(40, 256, device=DEVICE) / 16
    torch.testing.assert_close(decode_linear(x, w), F.linear(x, w), **TOL[torch.float32])


def test_a_shape_where_cublas_measured_faster_runs_unfused(monkeypatch):
    """A sweep row whose prologue kernel + cuBLAS beat every fused launch becomes UNFUSED: the same outputs
    (y, the new residual, the normed rows) from the prologue's own kernel and F.linear."""
    from agentrt_kernels.triton import decode_linear as module

    monkeypatch.setattr(module, "TUNED_LAUNCHES", {})
    launch = {"BLOCK_N": 16, "BLOCK_K": 64, "FMA": False, "SWAP": True, "num_warps": 4, "num_stages": 2}
    module.load_tuned_launches([{"N": 24, "K": 128, "rows": 4, "best_launch": launch, "best_s": 2.0, "unfused_s": 1.0},
                                {"N": 24, "K": 64, "rows": 4, "best_launch": launch, "best_s": 1.0, "unfused_s": 2.0}])
    assert module.tuned_launch(24, 128, 3) is module.UNFUSED and module.tuned_launch(24, 64, 3) == launch
    calls = []
    monkeypatch.setattr(module, "_decode_linear_kernel", None)  # the fused kernel must not run
    real = module._unfused
    monkeypatch.setattr(module, "_unfused", lambda *a: calls.append(1) or real(*a))
    _seed("unfused")
    half = torch.float16  # the table is for 16-bit rows
    x, res = torch.randn(3, 128, device=DEVICE).to(half), torch.randn(3, 128, device=DEVICE).to(half)
    norm_w = (1 + 0.1 * torch.randn(128, device=DEVICE)).to(half)
    w, b = (torch.randn(24, 128, device=DEVICE) / 11).to(half), torch.randn(24, device=DEVICE).to(half)
    got, got_res, got_normed = decode_linear(x, w, b, norm=(norm_w, 1e-6), residual=res, return_normed=True)
    normed, want_res = _torch_norm(x, norm_w, 1e-6, res)
    torch.testing.assert_close(got_normed, normed, **TOL[half])  # the GPU's rsqrt: not bit-equal there
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, F.linear(normed, w, b), **TOL[half])
    gate_up = torch.randn(3, 256, device=DEVICE).to(half)
    torch.testing.assert_close(decode_linear(gate_up, w, silu_mul=True), F.linear(_torch_silu_mul(gate_up), w),
                               **TOL[half])
    assert len(calls) == 2


TABLES = sorted(p.name for p in (Path(__file__).parents[2] / "agentrt_kernels" / "triton" / "tuned").glob(
    "decode_linear_*.json"))


@pytest.mark.parametrize("table", TABLES)
def test_each_gpus_table_loads_and_each_of_its_launches_computes_the_product(monkeypatch, table):
    """The committed sweep rows (tuned/decode_linear_<GPU>.json) become launches: UNFUSED exactly where the
    prologue + cuBLAS measured faster, and every fused launch in it runs the kernel right (a small shape)."""
    import json

    from agentrt_kernels.triton import decode_linear as module

    rows = json.loads((module._TUNED_DIR / table).read_text())
    monkeypatch.setattr(module, "TUNED_LAUNCHES", {})
    module.load_tuned_launches(rows)
    for row in rows:
        launch = module.tuned_launch(row["N"], row["K"], row["rows"])
        assert (launch is module.UNFUSED) == (row["unfused_s"] <= row["best_s"]), row["case"]
        if launch is module.UNFUSED:
            continue
        _seed(table, row["case"], row["rows"])
        dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the sweep's dtype on a GPU
        x, w = torch.randn(row["rows"], 320, device=DEVICE), torch.randn(48, 320, device=DEVICE) / 18
        norm_w = 1 + 0.1 * torch.randn(320, device=DEVICE)
        x, w, norm_w = x.to(dtype), w.to(dtype), norm_w.to(dtype)
        got = decode_linear(x, w, norm=(norm_w, 1e-6), launch=launch)
        want = F.linear(_torch_norm(x, norm_w, 1e-6).float(), w.float()).to(dtype)
        assert_close(got, want, dtype)
    # fp32 rows never take the table (its 16-bit tiles would not fit fp32's shared memory on the GPU)
    fused = next(r for r in rows if r["rows"] > 1 and r["unfused_s"] > r["best_s"])
    assert module.tuned_launch(fused["N"], fused["K"], 8, torch.device("cuda"), itemsize=2)["SWAP"]
    assert module.tuned_launch(fused["N"], fused["K"], 8, torch.device("cuda"), itemsize=4) is module.UNFUSED


def test_the_sweep_writes_its_winners_over_the_tables_rows_of_the_same_shape(monkeypatch, tmp_path):
    """``benchmarks.decode_linear --write-table``: a swept shape's row replaces the table's row of the same
    (N, K, rows); the others stay; the launches it loads are the new winners."""
    import json

    from agentrt_kernels.triton import decode_linear as module
    from benchmarks.decode_linear import write_table

    monkeypatch.setattr(module, "_TUNED_DIR", tmp_path)
    old = {"BLOCK_N": 64, "BLOCK_K": 256, "FMA": False, "SWAP": True, "num_warps": 4, "num_stages": 3}
    new = {**old, "BLOCK_N": 16}

    def row(n, rows, launch, best_s):
        return {"case": "c", "rows": rows, "N": n, "K": 256, "best_launch": launch, "best_s": best_s,
                "unfused_s": 1.0, "cublas_s": 0.5, "launches": []}

    write_table([row(40, 8, old, 0.5), row(48, 8, old, 0.5)], "Some GPU", "then")
    path = write_table([row(40, 8, new, 0.4), row(40, 1, new, 2.0)], "Some GPU", "now")
    assert path == tmp_path / "decode_linear_Some_GPU.json"
    table = json.loads(path.read_text())
    assert sorted((r["N"], r["rows"], r["measured"]) for r in table) == [(40, 1, "now"), (40, 8, "now"),
                                                                        (48, 8, "then")]
    assert all("launches" not in r for r in table)
    monkeypatch.setattr(module, "TUNED_LAUNCHES", {})
    module.load_tuned_launches(table)
    assert module.tuned_launch(40, 256, 8) == new and module.tuned_launch(48, 256, 8) == old
    assert module.tuned_launch(40, 256, 1) is module.UNFUSED  # cuBLAS measured faster there


_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import decode_linear as module

module.pdl = lambda device: True  # launched as on a Hopper GPU: programmatic dependent launch
rows = []
for n, k, m, launch in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    with captured_launches() as launches:
        module.decode_linear(torch.zeros(m, k, **bf), torch.zeros(n, k, **bf),
                             norm=(torch.ones(k, **bf), 1e-6), launch=launch)
    for fn, args, options in launches:
        r = compile_sm90(fn, args, **options)
        rows.append(dict(fma=args["FMA"], split_k=args["SPLIT_K"], spill_stores=r["spill_stores"],
                         launch_order=r["launch_order"]))
print(json.dumps(rows))
"""


def test_a_hopper_launch_waits_for_the_previous_kernel_first():
    """Compiled for sm_90a as an H100 / H200 launches it (q_b's shape, GLM-4.7-Flash, both kinds of launch; qkv_a's
    with its reduction split, at 8 rows and on the 32-row tile): the wait for the previous kernel, then the next
    kernel let in, without spills."""
    from tests.kernels.sm90_compile import compiled_rows

    one_row = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3, "FMA": True, "SWAP": True}
    dot = {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "FMA": False, "SWAP": True}
    rows = compiled_rows(_SM90_SCRIPT, [[5120, 768, 8, dot], [5120, 768, 1, one_row],
                                        [1344, 2048, 8, {**dot, "SPLIT_K": 8}],
                                        [1344, 2048, 1, {**one_row, "BLOCK_K": 256, "SPLIT_K": 4}],
                                        [1344, 2048, 32, {**dot, "SPLIT_K": 4}]])
    assert [(r["fma"], r["split_k"]) for r in rows] == [(False, 1), (True, 1), (False, 8), (True, 4), (False, 4)]
    for r in rows:
        assert r["spill_stores"] == 0 and r["launch_order"] == ["wait", "launch_dependents"], r
