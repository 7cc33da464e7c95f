"""The RoPE kernel (with the q/k norms and the paged store fused) as compiled for an H100 / H200 (sm_90a, Triton's
bundled ptxas, no GPU needed) at the production shapes it runs at: the whole head stays in registers."""

_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import rotary as m

rows = []
for name, hq, hkv, d, rd, norm, zero_centered in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    t = 8
    qkv = torch.zeros(t, (hq + 2 * hkv) * d, **bf)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    cos = sin = torch.zeros(1024, rd // 2, **bf)
    kc = vc = torch.zeros(4, 16, hkv, d, **bf)
    kw = dict(q_norm_weight=torch.zeros(d, **bf), k_norm_weight=torch.zeros(d, **bf), zero_centered=zero_centered)
    with captured_launches() as launches:
        m.rotary_and_store(torch.zeros(t, dtype=torch.int64), q, k, v, cos, sin, kc, vc,
                           torch.zeros(t, dtype=torch.int64), **(kw if norm else {}))
    fn, args, options = launches[0]
    r = compile_sm90(fn, args, **options)
    rows.append(dict(shape=name, **{k: r[k] for k in ("registers", "spill_stores")}))
print(json.dumps(rows))
"""


def test_the_rotary_store_kernel_compiles_for_sm90_without_spills():
    """Qwen3.6-27B's full attention (24 / 4 heads of 256, RoPE on 64 channels, zero-centred q/k norms), Qwen3's
    (32 / 4 heads of 128, q/k norms) and Llama-3.1-8B's (32 / 8 heads of 128)."""
    from tests.kernels.sm90_compile import compiled_rows

    rows = compiled_rows(_SM90_SCRIPT, [["qwen3.6-27b", 24, 4, 256, 64, True, True],
                                        ["qwen3-30b-a3b", 32, 4, 128, 128, True, False],
                                        ["llama-3.1-8b", 32, 8, 128, 128, False, False]])
    assert len(rows) == 3
    for r in rows:
        assert r["spill_stores"] == 0, r
