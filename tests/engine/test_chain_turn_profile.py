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
