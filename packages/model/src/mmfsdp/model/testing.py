"""Helpers for tests and examples: synthetic Mistral3 batches, model pairs, relative differences.

`read_safetensors(dir)`, `assert_bit_exact(a, b)` and `mm_convert(*argv)` are the checkpoint
round-trip tests' helpers (`mm-convert GenericDCPConverter ...`, returning its exit code).

`model_pair(config)` builds our wrapper (the registered family whose
`config_class` the config is) and the plain HF model with the same random
weights; `model_inputs(batch)` is every key of a batch but the labels; `rel_diff(a, b)` is the tensor-wise relative difference the
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
from torch import nn
from transformers import Mistral3Config, PretrainedConfig

from mmfsdp.model.loss import IGNORE_INDEX
from mmfsdp.model.registry import get_model_entry, registered_model_ids
from mmfsdp.model.training_forward import model_inputs

__all__ = [
    "tiny_batch",
    "image_token_count",
    "model_pair",
    "rel_diff",
    "model_inputs",
    "read_safetensors",
    "assert_bit_exact",
    "mm_convert",
]


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (a tensor-wise relative difference, in float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0) if actual.numel() else 0.0


def read_safetensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a HF safetensors directory (one file or shards + index), by key."""
    from mmfsdp.ckpt import SafetensorsDir

    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, and per key the same dtype, shape and bits."""
    assert actual.keys() == expected.keys()
    for key in expected:
        a, b = actual[key], expected[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


def mm_convert(*argv) -> int:
    """`mm-convert GenericDCPConverter *argv` in this process; its exit code."""
    from mmfsdp.ckpt.cli import main

    return main(["GenericDCPConverter", *map(str, argv)])


def model_pair(
    config: PretrainedConfig, *, attn: str = "mmfsdp_sdpa", hf_attn: str = "sdpa", seed: int = 0
) -> tuple[nn.Module, nn.Module]:
    """Our wrapper (attention `attn`) and the plain HF model (attention `hf_attn`) with the same random weights.

    Each model gets its own copy of `config` (HF keeps the attention choice on the config object).
    """
    (ours_class,) = [
        entry.model_class for entry in map(get_model_entry, registered_model_ids()) if type(config) is entry.config_class
    ]
    reference_class = ours_class.__bases__[-1]  # (TrainingForwardMixin, the HF class)
    torch.manual_seed(seed)
    reference = reference_class._from_config(copy.deepcopy(config), attn_implementation=hf_attn)
    ours = ours_class._from_config(copy.deepcopy(config), attn_implementation=attn)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


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


def qwen3_vl_sample(
    config: PretrainedConfig, length: int, grids: Sequence[tuple[int, int]] = (), *, prompt_len: int = 2, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One Qwen3-VL sample of `length` tokens: `prompt_len` text tokens, then per image `(h, w)` (in patches,
    multiples of the spatial merge) `<vision_start>`, `h·w / merge²` image tokens, `<vision_end>`, then text.

    Labels copy the input ids from the end of the last image on (-100 before); `pixel_values` are
    `[Σ h·w, C · temporal_patch · patch²]`, `image_grid_thw` `[[1, h, w], ...]`.
    """
    vision = config.vision_config
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(config.vision_end_token_id + 1, config.text_config.vocab_size, (length,), generator=generator)
    labels = input_ids.clone()
    at = prompt_len
    for h, w in grids:
        count = h * w // vision.spatial_merge_size**2
        if at + count + 2 > length:
            raise ValueError(f"image {h}x{w} ({count} tokens) does not fit in {length} tokens")
        input_ids[at] = config.vision_start_token_id
        input_ids[at + 1 : at + 1 + count] = config.image_token_id
        input_ids[at + 1 + count] = config.vision_end_token_id
        at += count + 2
    labels[:at] = IGNORE_INDEX
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    sample = {"input_ids": input_ids, "labels": labels}
    if grids:
        sample["pixel_values"] = torch.randn(sum(h * w for h, w in grids), patch_dim, generator=generator)
        sample["image_grid_thw"] = torch.tensor([[1, h, w] for h, w in grids])
    return sample


def qwen3_vl_batch(
    rows: Sequence[Sequence[dict[str, torch.Tensor]]], *, seq_len: int, packing: bool = False, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Rows of `qwen3_vl_sample`s, right-padded to `seq_len`; with `packing` several samples a row and
    `cu_seq_lens` / `max_length` (a row's padding is one more segment), else one sample a row and an attention mask."""
    batch_size = len(rows)
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    segments, pixels, grids = [], [], []
    for b, row in enumerate(rows):
        if not packing and len(row) != 1:
            raise ValueError("several samples in a row need packing=True")
        start = 0
        for sample in row:
            n = len(sample["input_ids"])
            input_ids[b, start : start + n] = sample["input_ids"]
            labels[b, start : start + n] = sample["labels"]
            attention_mask[b, start : start + n] = 1
            segments.append(n)
            start += n
            if "pixel_values" in sample:
                pixels.append(sample["pixel_values"])
                grids.append(sample["image_grid_thw"])
        if start < seq_len:
            segments.append(seq_len - start)
    batch = {"input_ids": input_ids, "labels": labels}
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
        batch["image_grid_thw"] = torch.cat(grids)
    if packing:
        cu_seq_lens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seq_lens[1:] = torch.tensor(segments).cumsum(0)
        batch.update(cu_seq_lens=cu_seq_lens, max_length=max(segments))
    else:
        batch["attention_mask"] = attention_mask
    return batch
