"""Collators: samples -> one padded batch dict, registry keyed by `collate_param.model_name`.

A collator receives *rows*, each a list of samples (one sample per row without
packing, several with packing). Per row the samples' tokens are concatenated; the
batch is right-padded to the longest row rounded up to `pad_to_multiple_of`
(`input_ids` with the pad id, `labels` with -100, `attention_mask` 0).

`sample_multiple` (context parallel's `required_multiple`) makes every sample's
length a multiple of it: without packing it joins the row multiple; with packing
each sample is followed by its own padding up to the multiple (pad ids, labels
-100, attention_mask 0, positions running on), which stays inside the sample's
`cu_seq_lens` segment, so context parallel can split every packed sample.

`position_ids` restart at 0 for every sample. Without packing a row's positions run
on through its padding (`arange(S)`). With packing the padding of a row is a segment
of its own (positions 0, 1, ... again), and `cu_seq_lens` lists every segment's
boundaries over the flattened `B·S` tokens (int32, from 0 to `B·S`), so the
boundaries derived from `position_ids` and `cu_seq_lens` always agree and varlen
attention never mixes two samples (or a sample and padding). `max_length` is the
longest segment.

Images of all samples, in row order, are padded with zeros at the bottom/right to
the batch's tallest and widest image and stacked into `pixel_values` `[N, 3, H, W]`
— the layout the HF Pixtral image processor returns for the same images —
with `image_sizes` `[N, 2]` (height, width). Both keys are absent when no sample
has an image.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from mmfsdp.config import Registry

from mmfsdp.data.templates import IGNORE_INDEX

__all__ = ["PixtralCollator", "collator_names", "get_collator", "register_collator"]

_COLLATORS: Registry[type] = Registry("collator", "data.dataloader_param.collate_param.model_name")


def register_collator(cls: type) -> type:
    return _COLLATORS.register(cls.name, cls)


def collator_names() -> list[str]:
    return _COLLATORS.names()


def get_collator(name: str) -> type:
    return _COLLATORS.get(name)


def _pad_images(images: list[torch.Tensor]) -> torch.Tensor:
    height = max(img.shape[-2] for img in images)
    width = max(img.shape[-1] for img in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for i, img in enumerate(images):
        out[i, :, : img.shape[-2], : img.shape[-1]] = img
    return out


@register_collator
class PixtralCollator:
    """Pads text, restarts positions per sample, stacks Pixtral images; with packing adds `cu_seq_lens`."""

    name = "pixtral"

    def __init__(self, *, pad_token_id: int, pad_to_multiple_of: int = 1, packing: bool = False, sample_multiple: int = 1):
        assert pad_to_multiple_of >= 1 and sample_multiple >= 1
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = math.lcm(pad_to_multiple_of, sample_multiple)
        self.packing = packing
        self.sample_multiple = sample_multiple

    def _span(self, num_tokens: int) -> int:
        """Tokens a sample occupies in its row: with packing, its length rounded up to `sample_multiple`."""
        if not self.packing:
            return num_tokens
        return math.ceil(num_tokens / self.sample_multiple) * self.sample_multiple

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = [[r] if isinstance(r, dict) else list(r) for r in rows]
        assert rows and all(rows), "a batch needs at least one row and every row at least one sample"
        if not self.packing:
            assert all(len(r) == 1 for r in rows), "several samples in a row need packing=True"
        row_lens = [sum(self._span(len(s["input_ids"])) for s in row) for row in rows]
        seq_len = math.ceil(max(row_lens) / self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(rows)

        input_ids = torch.full((batch_size, seq_len), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
        position_ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
        segments: list[int] = []
        images: list[torch.Tensor] = []
        sizes: list[torch.Tensor] = []
        for b, row in enumerate(rows):
            start = 0
            for sample in row:
                n = len(sample["input_ids"])
                span = self._span(n)
                input_ids[b, start : start + n] = sample["input_ids"]
                labels[b, start : start + n] = sample["labels"]
                attention_mask[b, start : start + n] = 1
                position_ids[b, start : start + span] = torch.arange(span)
                segments.append(span)
                start += span
                if "pixel_values" in sample:
                    images += list(sample["pixel_values"])
                    sizes.append(torch.as_tensor(sample["image_sizes"], dtype=torch.long).reshape(-1, 2))
            pad = seq_len - start
            if self.packing:
                position_ids[b, start:] = torch.arange(pad)
                if pad:
                    segments.append(pad)
            else:
                position_ids[b, start:] = torch.arange(start, seq_len)

        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids}
        if images:
            batch["pixel_values"] = _pad_images(images)
            batch["image_sizes"] = torch.cat(sizes)
        if self.packing:
            cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
            assert int(cu[-1]) == batch_size * seq_len
            batch["cu_seq_lens"] = cu
            batch["max_length"] = max(segments)
        return batch
