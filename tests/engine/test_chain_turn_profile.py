"""benchmarks.chain_turn_profile on the CPU (host times): a SnapKV chain's second turn is profiled and SnapKV's
named vote and compaction ranges are found in it, the chain compacted back to its budget."""


def test_a_chain_turn_is_split_into_vote_and_compaction():
    from benchmarks import chain_turn_profile

    r = chain_turn_profile.main(["--shape", "tiny", "--history", "300", "--new-tokens", "60", "--budget", "64",
                                 "--window", "8", "--max-num-batched-tokens", "64", "--repeats", "1",
                                 "--device", "cpu"])
    (turn,) = r["turns"]
    assert turn["vote_ms"] > 0 and turn["compact_ms"] > 0 and turn["wall_ms"] > turn["vote_ms"]
    assert turn["chain_logical_tokens"] > 360 and turn["chain_held_slots_max"] <= 64 + 8


def test_the_split_counts_kernels_not_a_ranges_span_on_the_gpu_timeline():
    """Stand-ins for profiler events: the vote range launched a received-attention kernel (40 us) and, in a child
    op, a top-k (10 us); its GPU-side span (500 us, gaps included) carries the range's name too and must not
    count. Outside the ranges: a prefill attention kernel (30 us) and a GEMM (100 us)."""
    from types import SimpleNamespace as E

    import torch

    from benchmarks.chain_turn_profile import split_kernel_time

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    k = lambda name, us: E(name=name, duration=us)  # noqa: E731
    child = E(name="aten::topk", device_type=cpu, kernels=[k("topk_kernel", 10.0)], cpu_children=[])
    vote = E(name="snapkv.vote", device_type=cpu, kernels=[k("_received_attention_kernel", 40.0)],
             cpu_children=[child], cpu_time_total=900.0)
    events = [vote, child,
              E(name="snapkv.vote", device_type=gpu, device_time_total=500.0),
              E(name="_received_attention_kernel", device_type=gpu, device_time_total=40.0),
              E(name="topk_kernel", device_type=gpu, device_time_total=10.0),
              E(name="_prefill_attention_kernel", device_type=gpu, device_time_total=30.0),
              E(name="nvjet_gemm", device_type=gpu, device_time_total=100.0)]
    got = split_kernel_time(events, on_gpu=True)
    assert got == {"vote_ms": 0.05, "compact_ms": 0.0, "attention_ms": 0.03, "other_ms": 0.1, "vote_host_ms": 0.9,
                   "compact_host_ms": 0.0}
