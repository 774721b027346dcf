"""Mistral3's test helpers: synthetic batches for a tiny config (`Mistral3TestKit.tiny_config`).

`tiny_batch(config, ...)` lays out `batch_size` rows of `seq_len` tokens; images
go, in order, into consecutive rows (image `i` into row `i · B // num_images`) as the right number of
image tokens (`(h / 16) · (w / 16)` for patch 8 and spatial merge 2). Labels
copy the input ids, with -100 on image tokens and on a prompt prefix of
`prompt_len` tokens; positions after `lengths[b]` are right padding.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import Mistral3Config

from mmfsdp.model.loss import IGNORE_INDEX

__all__ = ["tiny_batch", "image_token_count"]


def image_token_count(config: Mistral3Config, height: int, width: int) -> int:
    step = config.vision_config.patch_size * config.spatial_merge_size
    return (height // step) * (width // step)


def tiny_batch(
    config: Mistral3Config,
    *,
    batch_size: int = 2,
    seq_len: int = 32,
    image_sizes: Sequence[tuple[int, int]] = ((32, 32), (32, 48)),
    prompt_len: int = 4,
    lengths: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A dict with input_ids, labels, attention_mask, position_ids (`[B, S]`) and, with images, pixel_values and image_sizes."""
    generator = torch.Generator().manual_seed(seed)
    vocab = config.text_config.vocab_size
    image_token = config.image_token_index
    low = image_token + 1
    input_ids = torch.randint(low, vocab, (batch_size, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, :prompt_len] = IGNORE_INDEX
    next_free = [1] * batch_size
    for index, (height, width) in enumerate(image_sizes):
        row = index * batch_size // len(image_sizes)
        count = image_token_count(config, height, width)
        start = next_free[row]
        if start + count > seq_len:
            raise ValueError(f"image {index} ({height}x{width}, {count} tokens) does not fit in row {row} of {seq_len} tokens")
        input_ids[row, start : start + count] = image_token
        labels[row, start : start + count] = IGNORE_INDEX
        next_free[row] = start + count + 1
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if lengths is not None:
        for row, length in enumerate(lengths):
            labels[row, length:] = IGNORE_INDEX
            attention_mask[row, length:] = 0
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(seq_len).expand(batch_size, seq_len).clone(),
    }
    if image_sizes:
        side = max(max(h for h, _ in image_sizes), max(w for _, w in image_sizes))
        pixel_values = torch.zeros(len(image_sizes), config.vision_config.num_channels, side, side)
        for index, (height, width) in enumerate(image_sizes):
            pixel_values[index, :, :height, :width] = torch.randn(config.vision_config.num_channels, height, width, generator=generator)
        batch["pixel_values"] = pixel_values
        batch["image_sizes"] = torch.tensor([list(size) for size in image_sizes])
    return batch
