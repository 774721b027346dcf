"""DAPO's dynamic sampling without processes (`mmfsdp.train.grpo_sampling`): which groups a step keeps (the first N
varying ones in the global order, whatever the ranks' order), when the rounds stop (enough found, or the cap), where
the kept groups are on each rank, and how a rank's completions fill the same number of micro-batches as every other
rank's; with a token budget, how a rank's sequences fill micro-batches within it and how the ranks come to the same
count; with balance, how the kept completions of all ranks are planned over them."""

import numpy as np
import pytest
import torch

from mmfsdp.train.grpo_sampling import (
    balanced_layout, budget_chunks, equal_chunks, group_owners, keep_first_varying, kept_layout, micro_batch_count,
    round_order, sample_rounds, split_evenly,
)


def _flags(*values):
    return torch.tensor(values, dtype=torch.bool)


def test_keeps_the_first_varying_groups_in_the_keys_order_not_the_gathered_one():
    keys = [(0, 30), (0, 10), (0, 20), (1, 5), (0, 40)]
    kept = keep_first_varying(keys, _flags(True, True, False, True, True), target=2)
    assert kept.tolist() == [True, True, False, False, False]  # (0, 10) and (0, 30): round 0 before round 1
    assert keep_first_varying(keys, _flags(True, True, False, True, True), target=3).tolist() == [
        True, True, False, False, True]
    assert keep_first_varying(keys, _flags(False, False, False, True, False), target=3).tolist() == [
        False, False, False, True, False]  # fewer vary than wanted: all of them
    assert not keep_first_varying(keys, _flags(False, False, False, False, False), target=3).any()


def test_the_same_groups_whatever_the_order_the_ranks_gathered_them_in():
    """A layout changes the gathered order of a round's groups (1 process: a, b, c, d; 2 ranks: a, c, b, d), never the
    set of groups nor their keys."""
    groups = {"a": ((0, 3), True), "b": ((0, 1), False), "c": ((0, 2), True), "d": ((0, 0), True)}
    for order in (["a", "b", "c", "d"], ["a", "c", "b", "d"], ["d", "c", "b", "a"]):
        kept = keep_first_varying([groups[g][0] for g in order], _flags(*(groups[g][1] for g in order)), 2)
        assert {g for g, k in zip(order, kept.tolist()) if k} == {"c", "d"}


def test_round_order_is_a_fixed_pseudo_random_order():
    order = sorted(range(20), key=lambda index: round_order(1234, 3, index))
    assert order != list(range(20)) and order == sorted(range(20), key=lambda index: round_order(1234, 3, index))
    assert order != sorted(range(20), key=lambda index: round_order(1234, 4, index))  # another generation


def _rounds(*flags):
    """`next_round` over fixed rounds: keys (round, position), the given flags; records the rounds asked for."""
    asked = []

    def next_round(r):
        asked.append(r)
        return [(r, j) for j in range(len(flags[r]))], _flags(*flags[r])

    return next_round, asked


def test_stops_once_enough_groups_vary():
    next_round, asked = _rounds([True, False, False, True], [True, True, False, True], [True, True, True, True])
    selection = sample_rounds(next_round, max_rounds=5)
    assert asked == [0, 1] and (selection.rounds, selection.target, selection.found) == (2, 4, 4)
    assert selection.kept.tolist() == [True, False, False, True, True, True, False, False]


def test_one_round_when_every_group_varies():
    next_round, asked = _rounds([True, True, True], [True, True, True])
    selection = sample_rounds(next_round, max_rounds=3)
    assert asked == [0] and selection.kept.tolist() == [True, True, True] and selection.rounds == 1


def test_the_cap_ends_the_rounds_with_what_was_found():
    next_round, asked = _rounds([False, True, False, False], [False, False, False, True], [True, True, True, True])
    selection = sample_rounds(next_round, max_rounds=2)
    assert asked == [0, 1] and (selection.rounds, selection.target, selection.found) == (2, 4, 2)
    assert selection.kept.tolist() == [False, True, False, False, False, False, False, True]


def test_nothing_varies():
    next_round, asked = _rounds([False, False], [False, False], [False, False])
    selection = sample_rounds(next_round, max_rounds=3)
    assert asked == [0, 1, 2] and selection.found == 0 and selection.kept.tolist() == [False] * 6


def test_no_resampling_only_drops():
    next_round, asked = _rounds([True, False, True], [True, True, True])
    selection = sample_rounds(next_round, max_rounds=1)
    assert asked == [0] and selection.kept.tolist() == [True, False, True]


def test_group_owners_follow_the_gathered_offsets():
    # 2 generations; rank 0 holds 2 prompts, rank 1 one, rank 2 two
    assert group_owners([0, 4, 6, 10], 2) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]
    assert group_owners([0, 6], 3) == [(0, 0), (0, 1)]


def test_kept_layout_puts_each_ranks_groups_together():
    G = 2
    owners = [[(0, 0), (0, 1), (1, 0), (1, 1)], [(0, 0), (1, 0)]]  # 2 rounds on 2 ranks
    kept = _flags(False, True, True, False, True, True)
    rank0 = kept_layout(owners, kept, num_generations=G, dp_size=2, dp_rank=0)
    rank1 = kept_layout(owners, kept, num_generations=G, dp_size=2, dp_rank=1)
    assert rank0.groups == [(0, 1), (1, 0)] and rank1.groups == [(0, 0), (1, 0)]
    assert rank0.per_rank == rank1.per_rank == [2, 2]
    # the rounds' tables side by side: round 0's groups are columns 0-7, round 1's 8-11
    assert rank0.columns.tolist() == rank1.columns.tolist() == [2, 3, 8, 9, 4, 5, 10, 11]
    assert (rank0.offset, rank1.offset) == (0, 4)
    none = kept_layout(owners, _flags(*[False] * 6), num_generations=G, dp_size=2, dp_rank=1)
    assert none.groups == [] and none.columns.numel() == 0 and none.per_rank == [0, 0] and none.offset == 0


def test_kept_layout_keeps_everything_in_order_without_dynamic_sampling():
    owners = [group_owners([0, 6, 9], 3)]
    layout = kept_layout(owners, _flags(True, True, True), num_generations=3, dp_size=2, dp_rank=1)
    assert layout.columns.tolist() == list(range(9)) and layout.groups == [(0, 0)] and layout.offset == 6


@pytest.mark.parametrize(("kept", "size", "count"), [([4, 4], 2, 2), ([3, 1], 1, 3), ([0, 0], 2, 1), ([5, 0], 2, 3)])
def test_every_rank_runs_as_many_micro_batches_as_the_fullest(kept, size, count):
    assert micro_batch_count(kept, size) == count


def test_split_evenly():
    assert split_evenly(8, 2) == [4, 4]
    assert split_evenly(12, 3) == [4, 4, 4]
    assert split_evenly(7, 3) == [3, 2, 2]
    assert split_evenly(2, 3) == [1, 1, 0]  # fewer completions than micro-batches: a filler
    assert split_evenly(0, 2) == [0, 0]


def test_budget_chunks_pack_in_order_within_the_budget():
    tokens = [30, 30, 50, 20, 90, 10]
    assert budget_chunks(tokens, [0.0] * 6, 80, packing=True) == [2, 2, 1, 1]  # 60 | 70 | 90 alone | 10
    assert budget_chunks([30, 30, 30, 50], [0.0] * 4, 90, packing=False) == [3, 1]  # padded: rows x the longest
    assert budget_chunks([30, 30, 30, 50], [0.0] * 4, 90, packing=True) == [3, 1]
    assert budget_chunks([30, 30, 30, 50], [0.0] * 4, 80, packing=True) == [2, 2]
    assert budget_chunks(tokens, [25.0, 0, 0, 0, 0, 0], 80, packing=True) == [1, 2, 1, 1, 1]  # + vision work
    assert budget_chunks([200], [0.0], 80, packing=True) == [1]  # heavier than the budget: alone
    assert budget_chunks([], [], 80, packing=True) == []


def test_equal_chunks_split_the_widest_then_add_fillers():
    assert equal_chunks([4, 1], 2) == [4, 1]
    assert equal_chunks([4, 1], 3) == [2, 2, 1]
    assert equal_chunks([3, 3], 3) == [2, 1, 3]  # the first of equals, the larger half first
    assert equal_chunks([2, 1], 5) == [1, 1, 1, 0, 0]  # fewer sequences than micro-batches: fillers
    assert equal_chunks([], 2) == [0, 0]
    assert sum(equal_chunks([5, 2, 7], 6)) == 14


def test_balanced_layout_gives_every_kept_completion_to_one_rank_in_as_many_micro_batches():
    """Balanced steps: every rank computes the same plan from the gathered numbers; each completion trains on
    exactly one rank, the ranks run as many micro-batches, the heavy sequences spread over the ranks, and a step
    that kept nothing runs one filler everywhere."""
    from mmfsdp.data.balance import CostModel

    tokens = np.array([300, 20, 20, 20, 280, 20, 20, 20])  # the two long ones in one rank's groups before balance
    zeros = np.zeros(8, dtype=np.int64)
    for budget, packing in ((None, False), (None, True), (320, True), (320, False)):
        layouts = [balanced_layout(tokens, zeros, zeros, dp_size=2, dp_rank=r, micro_batch_size=4, budget=budget,
                                   packing=packing, cost_model=CostModel()) for r in range(2)]
        assert sorted(p for layout in layouts for p in layout.positions) == list(range(8)), budget
        assert len(layouts[0].chunks) == len(layouts[1].chunks)
        assert all(sum(layout.chunks) == len(layout.positions) for layout in layouts)
        assert layouts[0].num_batches == layouts[1].num_batches == sum(c > 0 for l in layouts for c in l.chunks)
        assert layouts[0].imbalance == layouts[1].imbalance
        if budget is None:  # SFT's fixed micro-batches: micro_batch_size sequences of similar lengths move whole
            assert all(c <= 4 for layout in layouts for c in layout.chunks)
            assert {0, 4} <= set(layouts[0].positions) or {0, 4} <= set(layouts[1].positions)
        else:  # sequence by sequence: the two long ones on different ranks
            assert {0, 4} & set(layouts[0].positions) and {0, 4} & set(layouts[1].positions)
            assert layouts[0].imbalance < 1.1
    empty = balanced_layout(np.array([], dtype=np.int64), zeros[:0], zeros[:0], dp_size=2, dp_rank=1,
                            micro_batch_size=4, budget=None, packing=False, cost_model=CostModel())
    assert (empty.positions, empty.chunks, empty.num_batches) == ([], [0], 0)
