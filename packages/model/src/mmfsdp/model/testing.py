"""Helpers for tests and examples: synthetic Mistral3 batches, model pairs, relative differences.

`model_pair(config)` builds our wrapper and the plain HF model with the same
random weights; `rel_diff(a, b)` is the tensor-wise relative difference the
parity tests bound (max |a − b| / max |b|).

`tiny_batch(config, ...)` lays out `batch_size` rows of `seq_len` tokens; images
go, in order, into consecutive rows (image `i` into row `i · B // num_images`) as the right number of
image tokens (`(h / 16) · (w / 16)` for patch 8 and spatial merge 2). Labels
copy the input ids, with -100 on image tokens and on a prompt prefix of
`prompt_len` tokens; positions after `lengths[b]` are right padding.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from mmfsdp.model.loss import IGNORE_INDEX
from mmfsdp.model.mistral3 import Mistral3ForConditionalGenerationFSDP

__all__ = ["tiny_batch", "image_token_count", "model_pair", "rel_diff", "model_inputs"]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_sizes")


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (a tensor-wise relative difference, in float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0) if actual.numel() else 0.0


def model_pair(
    config: Mistral3Config, *, attn: str = "mmfsdp_sdpa", hf_attn: str = "sdpa", seed: int = 0
) -> tuple[Mistral3ForConditionalGenerationFSDP, Mistral3ForConditionalGeneration]:
    """Our wrapper (attention `attn`) and the plain HF model (attention `hf_attn`) with the same random weights.

    Each model gets its own copy of `config` (HF keeps the attention choice on the config object).
    """
    torch.manual_seed(seed)
    reference = Mistral3ForConditionalGeneration._from_config(copy.deepcopy(config), attn_implementation=hf_attn)
    ours = Mistral3ForConditionalGenerationFSDP._from_config(copy.deepcopy(config), attn_implementation=attn)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's input keywords of a `tiny_batch` (everything but the labels)."""
    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


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
