"""The eviction methods' shared pieces (``policies/scoring.py``) against their definitions: 1D pooling at the
edges, voted selection with window counts that differ per head, the per-request query stash."""

import copy

import pytest
import torch

from tests.eviction_reference import pool_reference, top_positions


# --- pooling --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_pooling_matches_its_definition_at_the_edges(pooling, kernel):
    from policies.scoring import pool1d

    x = torch.rand(2, 11, generator=torch.Generator().manual_seed(kernel))
    got = pool1d(x, kernel, pooling)
    for h in range(2):
        torch.testing.assert_close(got[h], torch.tensor(pool_reference(x[h].tolist(), kernel, pooling)))


# --- voted selection, the query stash -------------------------------------------------------------------------
def test_voted_selection_with_window_counts_that_differ_per_head():
    """A pruned chain can leave heads with different numbers of window slots: each head keeps its own window
    plus the top (budget - |window|) of its other slots by pooled vote."""
    from policies.scoring import keep_voted_and_window

    g = torch.Generator().manual_seed(0)
    vote = torch.rand(3, 10, generator=g)
    pos = torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 10],
                        [0, 2, 3, 4, 5, 6, 8, 9, 10, 11]])
    got = keep_voted_and_window(vote, pos, 9, 6, 3, "max")
    for h in range(3):
        row = pos[h].tolist()
        win = [i for i, p in enumerate(row) if p >= 9]
        others = list(range(len(row) - len(win)))
        pooled = pool_reference(vote[h, : len(others)].tolist(), 3, "max")
        assert got[h].tolist() == top_positions(others, dict(zip(others, pooled)), 6 - len(win)) + win


def test_query_stash_rolls_keeps_a_pending_window_and_replaces_a_cut_back_history():
    from policies.scoring import QueryStash

    def rows(first, n):  # row i holds its position
        return torch.arange(first, first + n, dtype=torch.float32)[:, None, None].expand(n, 2, 3)

    def held(stash):
        q, pos = stash.rows_between(0, 0, 10**6)
        assert torch.equal(q[:, 0, 0].long(), pos)
        return pos.tolist()

    st = QueryStash(1, 4)
    st.push(0, rows(0, 6), 0)
    assert held(st) == [2, 3, 4, 5]
    st.push(0, rows(6, 1), 6)
    assert held(st) == [3, 4, 5, 6]
    st.push(0, rows(7, 2), 7, keep_from=4)  # the window [4, ...) waits: nothing at >= 4 is dropped
    assert held(st) == [4, 5, 6, 7, 8]
    st.push(0, rows(9, 1), 9)
    assert held(st) == [6, 7, 8, 9]
    st.push(0, rows(8, 1), 8)  # a history cut back to 8: the old row 9 is gone
    assert held(st) == [6, 7, 8] and st.rows_between(0, 7, 9)[1].tolist() == [7, 8]
    st.push(0, rows(20, 1), 20)  # a gap: older rows are dropped
    assert held(st) == [20]
    loaded = QueryStash.load(copy.deepcopy(st.export()), 4)
    assert held(loaded) == [20]


# --- the window's layout told on the host (TableHandle.ordered_from) -------------------------------------------
def _compacted_table(heads: int, kept: int, compacted_at: int, appended: int, seed: int):
    from engine.page_table import PageTable

    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(compacted_at, generator=gen)[:kept].sort().values for _ in range(heads)]
    n = kept + appended
    return PageTable(pages=list(range(-(-n // 4))), num_slots=n, layer_lens=[n], kept_positions=[torch.stack(rows)],
                     compacted_at=compacted_at)


@pytest.mark.parametrize("kept,compacted_at,appended", [(6, 20, 9), (6, 6, 3), (5, 40, 0)])
def test_ordered_from_is_where_the_positions_run_in_order(kept, compacted_at, appended):
    from engine.page_table import PageTable

    t = _compacted_table(3, kept, compacted_at, appended, seed=kept + appended)
    slot, pos = t.ordered_from(0)
    positions = t.positions(0, 3, torch.device("cpu"))
    n = positions.shape[1]
    assert torch.equal(positions[:, slot:], torch.arange(pos, pos + n - slot).expand(3, -1))
    assert bool((positions[:, :slot] < pos).all())
    plain = PageTable(pages=[0, 1], num_slots=7)
    assert plain.ordered_from(0) == (0, 0)


@pytest.mark.parametrize("window_start", [18, 20, 24, 29, 35])
def test_window_counts_from_the_host_equal_the_positions(window_start):
    """keep_voted_and_window with the table's ordered tail gives the selection it makes from the positions."""
    from policies.scoring import keep_voted_and_window

    t = _compacted_table(2, 8, 20, 12, seed=window_start)
    k_pos = t.positions(0, 2, torch.device("cpu"))
    vote = torch.rand(2, k_pos.shape[1], generator=torch.Generator().manual_seed(window_start))
    budget = 14
    if (k_pos >= window_start).sum(dim=1).max() > budget:
        pytest.skip("a window larger than the budget")
    want = keep_voted_and_window(vote, k_pos, window_start, budget, 3, "max")
    got = keep_voted_and_window(vote, k_pos, window_start, budget, 3, "max", t.ordered_from(0))
    assert torch.equal(got, want)
