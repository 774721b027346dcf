"""Synthetic LLaVA batches: rows of different lengths, right-padded, with CLIP images (one fixed size) as
`(image_size / patch_size)²` image tokens each."""

from collections.abc import Sequence

import torch
from transformers import LlavaConfig

from mmfsdp.model import IGNORE_INDEX

__all__ = ["llava_batch", "image_token_count"]


def image_token_count(config: LlavaConfig) -> int:
    """Tokens of one image: CLIP's patches (its CLS token dropped by the `default` feature selection)."""
    vision = config.vision_config
    cls = 1 if config.vision_feature_select_strategy == "full" else 0
    return (vision.image_size // vision.patch_size) ** 2 + cls


def llava_batch(
    config: LlavaConfig, *, lengths: Sequence[int], images_per_row: Sequence[int], prompt_len: int = 3, seed: int = 0
) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels`, `attention_mask` `[B, max(lengths)]` and, with images, `pixel_values` `[N, C, H, W]`.

    Row b holds `lengths[b]` tokens: `prompt_len` untrained text tokens, then `images_per_row[b]` images (their
    tokens untrained, one text token after each), then trained text; the rest is padding."""
    generator = torch.Generator().manual_seed(seed)
    seq_len, per_image = max(lengths), image_token_count(config)
    input_ids = torch.randint(
        config.image_token_id + 1, config.text_config.vocab_size, (len(lengths), seq_len), generator=generator
    )
    labels = input_ids.clone()
    attention_mask = torch.zeros_like(input_ids)
    for b, (length, num_images) in enumerate(zip(lengths, images_per_row, strict=True)):
        at = prompt_len
        for _ in range(num_images):
            if at + per_image + 1 > length:
                raise ValueError(f"{num_images} images of {per_image} tokens do not fit in row {b} of {length} tokens")
            input_ids[b, at : at + per_image] = config.image_token_id
            at += per_image + 1
        labels[b, :at] = IGNORE_INDEX
        labels[b, length:] = IGNORE_INDEX
        attention_mask[b, :length] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    num_images = sum(images_per_row)
    if num_images:
        vision = config.vision_config
        shape = (num_images, vision.num_channels, vision.image_size, vision.image_size)
        batch["pixel_values"] = torch.randn(shape, generator=generator)
    return batch
