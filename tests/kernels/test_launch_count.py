"""``benchmarks.launch_count``: the launches of an MLA layer's decode forward, of a hybrid's linear and
full-attention layers in a decode step, and of a SnapKV chain turn's vote and compaction, with the GPU paths
taken under Triton's interpreter. Pins what the fused kernels removed: the counts come from the operators and
launches dispatched, so code going back to the unfused torch ops fails this."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


def test_launch_counts_of_the_fused_paths(tmp_path):
    from benchmarks.launch_count import main

    r = main(["--json", str(tmp_path / "launches.json")])
    mla = r["mla-decode"]["by_op"]
    assert mla["triton:_latent_inputs_kernel"] == 1 and mla["triton:_route_grouped_sigmoid_kernel"] == 1
    assert "cat" not in mla and "clone" not in mla and "add" not in mla  # no concatenations, copies, shared add
    assert mla["mm"] == 3  # the packed down-projection, q_b_proj, o_proj: no router or shared-expert GEMMs
    assert "triton:_moe_align_scatter_kernel" not in mla  # a decode step's slots placed in the counting program
    assert mla["triton:_rms_norm_kernel"] == 2  # the input and q_a norms: the post-attention one is the router's
    assert mla["triton:_gate_partials_kernel"] == 1  # the gate product over hidden slices, before the routing
    assert mla["triton:_head_matmul_kernel"] == 2 and "bmm" not in mla  # the query through W_UK, out through W_UV
    assert mla["triton:_topk_sum_kernel"] == 1 and "sum" not in mla  # the experts' outputs added in one launch
    assert r["mla-decode"]["launches"] <= 14
    linear, full = r["hybrid-linear"]["by_op"], r["hybrid-attention"]["by_op"]
    assert linear["triton:_conv_update_kernel"] == linear["triton:_delta_step_kernel"] == 1
    assert linear["triton:_gated_rms_norm_kernel"] == 1 and r["hybrid-linear"]["launches"] <= 10
    assert full["triton:_rotary_kernel"] == 1  # the q/k norms, partial RoPE and the KV store in one launch
    assert "cat" not in full and "contiguous" not in full and r["hybrid-attention"]["launches"] <= 10
    vote, compact = r["snapkv.vote"]["by_op"], r["snapkv.compact"]["by_op"]
    # the 4 layers as rows of one block table over the whole pool: three kernels for all of them
    assert vote["triton:_merge_lse_kernel"] == 1 and vote["triton:_key_tile_kernel"] == 2 and "amax" not in vote
    assert vote["sort"] == 2  # one top-k for all layers
    assert "zeros" not in vote and r["snapkv.vote"]["launches"] <= 3 + 12
    assert compact["triton:_gather_kept_kernel"] == compact["triton:_scatter_kept_kernel"] == 1
    assert "index_put_" not in compact
