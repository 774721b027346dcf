"""Qwen3-VL's test helpers (also for Qwen3-VL MoE): synthetic samples and batches for a tiny config."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PretrainedConfig

from mmfsdp.model.loss import IGNORE_INDEX

__all__ = ["qwen3_vl_sample", "qwen3_vl_batch", "write_span"]


def write_span(input_ids: torch.Tensor, at: int, ids: tuple[int, int, int], count: int, what: str) -> int:
    """Write one media span at `at` of `input_ids`: `ids` = (start, placeholder, end) tokens, `count`
    placeholders between the two; returns the position after it (`ValueError` naming `what` when it does not
    fit)."""
    if at + count + 2 > len(input_ids):
        raise ValueError(f"{what} ({count} tokens) does not fit in {len(input_ids)} tokens")
    start, token, end = ids
    input_ids[at], input_ids[at + 1 : at + 1 + count], input_ids[at + 1 + count] = start, token, end
    return at + count + 2


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
        ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
        at = write_span(input_ids, at, ids, h * w // vision.spatial_merge_size**2, f"image {h}x{w}")
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


def rollout_probe_prompts(processor) -> tuple[dict, dict, bytes]:
    """Two chat prompts for rollout-engine checks, processed by a Qwen3-VL `processor`: one with a 64 x 64 PNG (a
    multiple of 32, so no processor resizes it: vLLM's pinned transformers resizes other sizes differently), one text
    only; (with the image, text only, the PNG's bytes)."""
    import io

    from PIL import Image

    image = Image.new("RGB", (64, 64), (235, 235, 235))
    image.paste((30, 90, 200), (12, 20, 52, 44))
    png = io.BytesIO()
    image.save(png, format="PNG")
    head, tail = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    with_image = processor(text=[f"{head}<|vision_start|><|image_pad|><|vision_end|>What is this?{tail}"],
                           images=[image], return_tensors="pt")
    text_only = processor(text=[f"{head}Count from one to ten:{tail}"], return_tensors="pt")
    return with_image, text_only, png.getvalue()
