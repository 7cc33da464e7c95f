"""``_common.last_to_arrive`` and ``arrival_counts``: the barrier the split decode linears and the MoE down GEMM's
top-k sum finish their tiles behind.

The kernels that use it reset the counter when done, so a wrong choice of finisher can hide there: under the
interpreter every program runs alone, one after another, and a barrier that let the first arrival finish (and
reset the count) would let every program finish in turn, the last one right. This kernel does not reset: it
counts the finishers and records what the finisher saw.
"""

import os

import torch

if not torch.cuda.is_available():  # as the other kernel tests: this process's kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from agentrt_kernels.triton._common import arrival_counts, last_to_arrive  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _arrive_kernel(count_ptr, stored_ptr, seen_ptr, finisher_ptr, GROUP: tl.constexpr):
    """Programs in groups of GROUP, one counter a group: each stores its id, then arrives; a finisher counts
    itself and reads back every id its group stored."""
    pid = tl.program_id(0)
    group = pid // GROUP
    tl.store(stored_ptr + pid, pid + 1)
    if last_to_arrive(count_ptr + group, GROUP):
        tl.atomic_add(finisher_ptr + group, 1)
        members = group * GROUP + tl.arange(0, GROUP)
        tl.store(seen_ptr + members, tl.load(stored_ptr + members, cache_modifier=".cg"))
        tl.store(finisher_ptr + tl.num_programs(0) // GROUP + group, pid)


def test_one_program_a_group_finishes_the_last_to_arrive_seeing_every_store():
    groups, group = 6, 8
    counts = torch.zeros(groups, dtype=torch.int32, device=DEVICE)
    stored = torch.zeros(groups * group, dtype=torch.int32, device=DEVICE)
    seen = torch.zeros_like(stored)
    finishers = torch.zeros(2 * groups, dtype=torch.int32, device=DEVICE)
    _arrive_kernel[(groups * group,)](counts, stored, seen, finishers, GROUP=group)
    assert finishers[:groups].tolist() == [1] * groups  # exactly one finisher a group
    assert counts.tolist() == [group] * groups  # every program arrived once (this kernel does not reset)
    assert torch.equal(seen, torch.arange(1, groups * group + 1, dtype=torch.int32, device=DEVICE))
    if DEVICE.type == "cpu":  # the interpreter runs programs in order: the last of each group arrives last
        assert finishers[groups:].tolist() == [g * group + group - 1 for g in range(groups)]


def test_arrival_counts_are_zeros_shared_by_one_stream_and_grow():
    a = arrival_counts(DEVICE, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and int(a.abs().sum()) == 0
    assert arrival_counts(DEVICE, 10).data_ptr() == a.data_ptr()  # the same stream's launches share it
    bigger = arrival_counts(DEVICE, a.numel() + 1)
    assert bigger.numel() > a.numel() and int(bigger.abs().sum()) == 0
