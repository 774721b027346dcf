"""Mistral3 with a micro-batch whose only image is one merged token (16x16 at patch 8, merge 2).

HF's `Mistral3Model.get_image_features` squeezes the token dim of a one-token call away and then fails to
split it; our model pads such a call with the placeholder image and drops its features
(`families/mistral3/model.py`), the mechanism vision DP's one-token shares use too.
"""

import torch

from mmfsdp.model import get_model_entry
from mmfsdp.model.families.mistral3.testing import tiny_batch
from mmfsdp.model.testing import assert_close


def _model():
    entry = get_model_entry("mistral3")
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    return entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa"), config


def _pixels(config, sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    channels = config.vision_config.num_channels
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    pixel_values = torch.zeros(len(sizes), channels, height, width)
    for i, (h, w) in enumerate(sizes):
        pixel_values[i, :, :h, :w] = torch.randn(channels, h, w, generator=generator)
    return pixel_values


def test_one_token_image_alone_encodes_as_in_a_larger_call():
    model, config = _model()
    pair = _pixels(config, [(16, 16), (32, 48)])
    with torch.no_grad():
        alone = model.model.get_image_features(pixel_values=pair[:1, :, :16, :16], image_sizes=torch.tensor([[16, 16]]))
        both = model.model.get_image_features(pixel_values=pair, image_sizes=torch.tensor([[16, 16], [32, 48]]))
    assert len(alone.pooler_output) == 1, "the placeholder's features are dropped"
    assert alone.pooler_output[0].shape == (1, config.text_config.hidden_size)
    assert_close(alone.pooler_output[0], both.pooler_output[0], 1e-6, "pooled image features")


def test_training_step_on_a_batch_whose_only_image_is_one_token():
    model, config = _model()
    batch = tiny_batch(config, batch_size=2, image_sizes=((16, 16),), lengths=(32, 20), seed=1)
    assert int((batch["input_ids"] == config.image_token_index).sum()) == 1
    labels = batch.pop("labels")
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]
    weights = (shift != -100).float() / (shift != -100).sum()
    loss = model(**batch, shift_labels=shift, loss_weights=weights).loss
    loss.backward()
    assert torch.isfinite(loss)
    patch_grad = model.model.vision_tower.patch_conv.weight.grad
    assert patch_grad is not None and patch_grad.abs().sum() > 0, "the one-token image trains the vision tower"
