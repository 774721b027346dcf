"""Vision data parallel's pure parts: the media cost model and the assignment of media to CP ranks.

The distributed parts (the gather and its backward, the placeholder of a rank without media) are checked
against the one-process run in test_model_qwen3vl_cp.py, test_model_cp_parity.py (model level) and
tests/test_e2e_text_only_parity.py (through the trainer, on mixed data).
"""

import pytest
import torch

from mmfsdp.model import get_model_entry
from mmfsdp.model.testing import assert_close
from mmfsdp.model.training_forward import vision_features
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


def _calls(family: str, config):
    """A `get_image_features` call of three images of different sizes, one of a single merged token."""
    generator = torch.Generator().manual_seed(0)
    if family == "mistral3":
        sizes = [(32, 48), (16, 16), (48, 32)]
        channels = config.vision_config.num_channels
        pixel_values = torch.zeros(len(sizes), channels, 48, 48)
        for i, (h, w) in enumerate(sizes):
            pixel_values[i, :, :h, :w] = torch.randn(channels, h, w, generator=generator)
        return {"pixel_values": pixel_values, "image_sizes": torch.tensor(sizes), "return_dict": True,
                "vision_feature_layer": config.vision_feature_layer}
    vision = config.vision_config
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [2, 4, 4]])
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=generator)
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "return_dict": True}


@pytest.mark.parametrize("family", ["mistral3", "qwen3_vl"])
def test_a_share_of_the_media_encodes_to_the_same_features(family):
    """What a rank encodes from `select_vision_media` equals those items' features in the whole call (the towers
    attend within an image), also for a share of a single one-token image."""
    entry = get_model_entry(family)
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    base, call = model.model, _calls(family, config)
    with torch.no_grad():
        whole = vision_features(base.get_image_features(**call))
        patches = model.vision_media_patches(call)
        assert len(patches) == 3 and patches[1] == 4
        for indices in ([1], [0, 2], [2]):
            part = base.get_image_features(**model.select_vision_media(call, indices))
            deepstack = getattr(part, "deepstack_features", None) or []
            kinds = [list(part.pooler_output)] + [list(layer) for layer in deepstack]
            num_kinds = len(whole) // 3
            assert len(kinds) == num_kinds
            for k, kind in enumerate(kinds):
                for j, index in enumerate(indices):
                    assert_close(kind[j], whole[k * 3 + index], 1e-6, f"{family} {indices} image {k}")
