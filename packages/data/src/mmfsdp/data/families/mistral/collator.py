"""The `pixtral` collator.

`pixtral` also returns `position_ids`, restarting at 0 for every sample (without
packing a row's positions run on through its padding, `arange(S)`; with packing
the end-of-row padding segment restarts too, so the boundaries derived from
`position_ids` and `cu_seq_lens` always agree). Images of all samples, in row
order, are padded with zeros at the bottom/right to the batch's tallest and widest
image and stacked into `pixel_values` `[N, 3, H, W]` — the layout the HF Pixtral
image processor returns for the same images — with `image_sizes` `[N, 2]` (height,
width). Both keys are absent when no sample has an image.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmfsdp.data.collators import _RowCollator, register_collator

__all__ = ["PixtralCollator", "pad_images"]


def pad_images(images: list[torch.Tensor]) -> torch.Tensor:
    height = max(img.shape[-2] for img in images)
    width = max(img.shape[-1] for img in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for i, img in enumerate(images):
        out[i, :, : img.shape[-2], : img.shape[-1]] = img
    return out


@register_collator
class PixtralCollator(_RowCollator):
    """Pads text, restarts positions per sample, stacks Pixtral images; with packing adds `cu_seq_lens`."""

    name = "pixtral"
    """`input_ids` pad with the tokenizer's pad id; `position_ids` padding continues the positions (see the module docstring)."""

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = self._rows(rows)
        text, spans, segments = self._text(rows)
        seq_len = text["input_ids"].shape[1]
        position_ids = torch.zeros_like(text["input_ids"])
        images: list[torch.Tensor] = []
        sizes: list[torch.Tensor] = []
        for b, row in enumerate(rows):
            for sample, (start, span) in zip(row, spans[b]):
                position_ids[b, start : start + span] = torch.arange(span)
                if "pixel_values" in sample:
                    images += list(sample["pixel_values"])
                    sizes.append(torch.as_tensor(sample["image_sizes"], dtype=torch.long).reshape(-1, 2))
            end = spans[b][-1][0] + spans[b][-1][1]
            position_ids[b, end:] = torch.arange(seq_len - end) if self.packing else torch.arange(end, seq_len)

        batch: dict[str, Any] = {"input_ids": text["input_ids"], "labels": text["labels"], "attention_mask": text["attention_mask"], "position_ids": position_ids}
        if images:
            batch["pixel_values"] = pad_images(images)
            batch["image_sizes"] = torch.cat(sizes)
        self._boundaries(batch, segments)
        return batch
