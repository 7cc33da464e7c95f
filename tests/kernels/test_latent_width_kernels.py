"""Kernels that methods launch over a latent (MLA) cache compile for an H100 / H200 at the real latent width.

A latent row is 576 channels (512 + 64 rope). Window votes (SnapKV, PyramidKV, the pruning scorers), decode
logits (H2O, TOVA, OmniKV) and Quest's page scores take the cache's head width as their tile, so a tile sized for
128-channel heads can need more shared memory than a block has (the window vote's key tile asked for 512 KiB on
an H200) or spill the page bounds to local memory. Each wrapper is called at the latent width with its own
choice of tiles, its launch captured instead of run (``benchmarks.kernel_resources.captured_launches``), and
compiled for sm_90a with Triton's bundled ptxas: no GPU needed. The values these kernels compute at wide heads
are checked against their references in tests/kernels/test_triton_selection.py (``WIDE``).
"""

from tests.kernels.sm90_compile import compiled_rows

_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import decode_logits, quest, received_attention

D, PAGE, PAGES = 576, 64, 40
rows = []
for hq in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    k_cache = torch.zeros(PAGES, PAGE, 1, D, **bf)
    bt = torch.zeros(2, 8, dtype=torch.int32)
    lens = torch.tensor([500, 300], dtype=torch.int32)
    window = torch.zeros(64, hq, D, **bf)
    qsl = torch.tensor([0, 32, 64], dtype=torch.int32)
    lse = torch.zeros(64, hq)
    decode = torch.zeros(2, hq, D, **bf)
    bounds = torch.zeros(PAGES, 1, D, **bf)
    calls = {
        "paged_lse": lambda: received_attention.paged_lse(window, k_cache, bt, lens, qsl, 0.1, 512, 32),
        "received_attention": lambda: received_attention.received_attention(
            window, k_cache, bt, lens, qsl, lse, 0.1, 512, 32),
        "paged_decode_logits": lambda: decode_logits.paged_decode_logits(decode, k_cache, bt, lens, 0.1, 512),
        "quest_page_scores": lambda: quest.quest_page_scores(decode, bounds, bounds, bt),
        "quest_decode_scores": lambda: quest.quest_decode_scores(decode, bounds, bounds, k_cache, bt, lens, PAGE),
    }
    for name, call in calls.items():
        with captured_launches() as launches:
            call()
        assert len(launches) == (2 if name == "paged_lse" else 1), (name, len(launches))  # + the partials' merge
        fn, args, options = launches[0]
        r = compile_sm90(fn, args, **options)
        rows.append(dict(kernel=name, hq=hq, **{k: r[k] for k in ("registers", "spill_stores", "shared_bytes")}))
print(json.dumps(rows))
"""

# the shared memory one block may use on an H100 / H200 (227 KiB)
SM90_BLOCK_SHARED_BYTES = 232448


def test_method_kernels_at_the_latent_width_fit_an_sm90_block():
    """16 (DeepSeek-V3 at TP 8), 20 (GLM-4.7-Flash) and 128 query heads (DeepSeek-V3): every launch fits a
    block's shared memory and keeps its values in registers (no spill stores)."""
    heads = [16, 20, 128]
    rows = compiled_rows(_SCRIPT, heads, timeout=600)
    assert len(rows) == 5 * len(heads)
    for r in rows:
        print(r)
        assert r["shared_bytes"] <= SM90_BLOCK_SHARED_BYTES and r["spill_stores"] == 0, r
