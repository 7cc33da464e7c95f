"""RetroInfer's GPU path (``attend_paged``: the cluster-gather Triton kernel + the estimate merge) against its
torch reference path (``attend``: every slot gathered, masked, softmax), which test_retroinfer checks against
the paper's definition. Without a GPU the kernel runs in Triton's CPU interpreter at tiny sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from engine.registry import create_method  # noqa: E402
from policies.retroinfer import ClusterIndex, kmeans  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(dtype, hkv, group, head_dim, page_size, kv_len, window, cluster_size, seed):
    g = torch.Generator().manual_seed(seed)
    num_pages = -(-kv_len // page_size) + 3
    k_cache = torch.randn(num_pages, page_size, hkv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: -(-kv_len // page_size)].to(torch.int32)
    slots = table.long()[torch.arange(kv_len) // page_size] * page_size + torch.arange(kv_len) % page_size
    keys = k_cache.flatten(0, 1)[slots].float()
    values = v_cache.flatten(0, 1)[slots].float()
    m = kv_len - window
    assign, centroids, counts = kmeans(keys[:m].transpose(0, 1).contiguous(), -(-m // cluster_size), 3)
    value_sum = torch.zeros_like(centroids).scatter_add_(
        1, assign[..., None].expand(-1, -1, head_dim), values[:m].transpose(0, 1))
    members = assign.argsort(dim=1, stable=True).to(torch.int32)
    offsets = torch.nn.functional.pad(counts.long().cumsum(1), (1, 0)).to(torch.int32)
    index = ClusterIndex(m, assign, centroids, counts, value_sum, members, offsets)
    q = torch.randn(hkv * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, table, keys, values, index


def to_device(index):
    return ClusterIndex(index.num_clustered, *(getattr(index, f).to(DEVICE) for f in (
        "assign", "centroids", "counts", "value_sum", "members", "offsets")))


@pytest.mark.parametrize("dtype,hkv,group,head_dim,page_size,kv_len,window,knobs", [
    (torch.float32, 2, 2, 32, 8, 150, 9, {"exact_clusters": 3, "estimated_clusters": 5}),
    (torch.float16, 1, 4, 64, 16, 97, 1, {"exact_clusters": 1, "estimated_clusters": 0}),
    (torch.bfloat16, 2, 1, 32, 4, 61, 5, {"exact_clusters": 0, "estimated_clusters": 2, "aggregate": "sum"}),
    (torch.float32, 2, 3, 16, 8, 40, 4, {"exact_clusters": 100, "estimated_clusters": 100}),
])
def test_kernel_path_equals_the_reference_path(dtype, hkv, group, head_dim, page_size, kv_len, window, knobs):
    q, k_cache, v_cache, table, keys, values, index = random_case(dtype, hkv, group, head_dim, page_size, kv_len,
                                                                  window, cluster_size=6, seed=kv_len)
    method = create_method("retroinfer", {"window": window, **knobs})
    want = method.attend(q.float(), keys, values, index)
    got = method.attend_paged(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE), kv_len,
                              to_device(index))
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


def test_kernel_reads_only_chosen_clusters_and_the_recent_range():
    """Poisoning every slot outside the chosen clusters and the recent range leaves the output unchanged."""
    q, k_cache, v_cache, table, keys, values, index = random_case(torch.float32, 2, 2, 32, 8, 120, 8, 6, seed=3)
    method = create_method("retroinfer", {"window": 8, "exact_clusters": 2, "estimated_clusters": 3})
    exact, _ = method._rank(q.view(2, 2, 32), index)
    chosen = torch.zeros(2, index.counts.shape[1], dtype=torch.bool).scatter_(1, exact, True)
    read = chosen.gather(1, index.assign)  # [Hkv, m]
    q, k_cache, v_cache, table, index = q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE), \
        to_device(index)
    before = method.attend_paged(q, k_cache, v_cache, table, 120, index)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for h in range(2):
        for p in (~read[h]).nonzero().flatten().tolist():
            page, off = table[p // 8].item(), p % 8
            poisoned_k[page, off, h] = float("nan")
            poisoned_v[page, off, h] = float("nan")
    after = method.attend_paged(q, poisoned_k, poisoned_v, table, 120, index)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_engine_decode_rows_take_the_same_answer_through_the_kernel(tiny_dirs):
    """Every decode row of a CPU engine run (GQA, mixed prompt lengths): ``attend_paged`` on the engine's own
    cache, block table and index equals the reference output the engine wrote."""
    llm = LLM(tiny_dirs["qwen3"], dtype="float32", device=DEVICE, page_size=4, max_num_batched_tokens=24,
              num_pages=256, enforce_eager=True,  # a decode graph's replay would bypass the wrapped hooks below
              method="retroinfer", method_config={"cluster_size": 4, "iters": 3, "exact_clusters": 3,
                                                  "estimated_clusters": 4, "window": 4, "dense_layers": 1})
    method, cache = llm.engine.method, llm.engine.cache
    after, checked = method.after_attention, []

    def after_attention(layer, batch, out, scores):
        after(layer, batch, out, scores)
        if layer < 1:
            return
        q, view, row = batch.scratch["retroinfer_q"], batch.view_for(layer), 0
        k_cache, v_cache = cache.layer_kv(layer)
        for i, (req, n) in enumerate(zip(batch.requests, view.query_lens_cpu)):
            index = method._index.get(req.request_id)
            if index is not None and n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                got = method.attend_paged(q[row], k_cache, v_cache, view.block_tables[i], view.kv_lens_cpu[i],
                                          index[layer - 1])
                torch.testing.assert_close(got, out[row], rtol=2e-5, atol=2e-5)
                checked.append(req.request_id)
            row += n

    select, views = method.select, []

    def counting_select(layer, q, batch):
        view = select(layer, q, batch)
        views.append(type(view).__name__)
        return view

    method.after_attention, method.select = after_attention, counting_select
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (20, 45, 70)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(checked) == 3 * 3 * (cache.spec.num_layers - 1)
    assert "SelectedSlotsView" in views  # all-decode steps: the backend's (overwritten) pass reads one slot
