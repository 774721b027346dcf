"""Vision data parallel's pure parts: the media cost model and the assignment of media to CP ranks.

The distributed parts (the gather and its backward, the placeholder of a rank without media) are checked
against the one-process run in test_model_qwen3vl_cp.py, test_model_cp_parity.py (model level) and
tests/test_e2e_text_only_parity.py (through the trainer, on mixed data).
"""

import pytest

from mmfsdp.model.vision_dp import assign_media, media_costs


def test_cost_grows_with_patches_and_their_square():
    small, large = media_costs([256, 1024], width=64)
    assert small == 256 * (1 + 256 / 384)
    assert large / small > 1024 / 256, "attention makes a 4× larger image more than 4× as costly"


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_every_item_goes_to_one_rank_and_loads_are_balanced(num_ranks):
    costs = media_costs([1024, 256, 768, 512, 256, 384, 1024, 128, 640], width=128)
    shares = assign_media(costs, num_ranks)
    assert len(shares) == num_ranks
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    assert all(share == sorted(share) for share in shares), "each share in the call's order"
    loads = [sum(costs[i] for i in share) for share in shares]
    # largest-first to the least loaded rank: no rank exceeds the mean by more than one item
    assert max(loads) <= sum(costs) / num_ranks + max(costs)
    assert assign_media(costs, num_ranks) == shares, "deterministic: every rank of the group computes the same"


def test_fewer_media_than_ranks_leaves_ranks_empty():
    assert assign_media([5.0, 9.0], 4) == [[1], [0], [], []]
    assert assign_media([], 2) == [[], []]


def test_equal_costs_go_round_robin_by_index():
    assert assign_media([1.0] * 5, 2) == [[0, 2, 4], [1, 3]]


def test_one_large_image_is_alone():
    assert assign_media([100.0, 10.0, 10.0, 10.0], 2) == [[0], [1, 2, 3]]
