"""The `qwen3_vl` collator (alias `qwen3vl`).

It returns no `position_ids`: Qwen3-VL computes its M-RoPE positions itself
from `input_ids`, `image_grid_thw`, `video_grid_thw` and `mm_token_type_ids` (0 text,
1 image token, 2 video token; transformers' `Qwen3VLModel` requires it whenever images
or videos are passed). Samples carry
their own `mm_token_type_ids` (from the image plugin's `token_inputs`); the
collator pads them with 0.
`pixel_values` `[Σ t·h·w, C·T·P·P]` are the samples' flattened patches concatenated
in row order and `image_grid_thw` `[N, 3]` their grids, as `Qwen2VLImageProcessor`
returns them for the same images; both are absent when no sample has an image.
Videos likewise: `pixel_values_videos` `[Σ t·h·w, C·T·P·P]` and `video_grid_thw`
`[N, 3]` concatenated in row order, as `Qwen3VLVideoProcessor` returns them, absent
when no sample has a video. Under packing each sample's media stay in its order, so
the model can take each sample's grids back in turn.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmfsdp.data.collators import _RowCollator, register_collator

__all__ = ["Qwen3VLCollator"]


@register_collator
class Qwen3VLCollator(_RowCollator):
    """Pads text, marks image (1) and video (2) tokens in `mm_token_type_ids`, concatenates Qwen-VL image and video
    patches in sample order; with packing adds `cu_seq_lens`."""

    name = "qwen3_vl"
    aliases = ("qwen3vl",)
    """`input_ids` pad with the tokenizer's pad id."""
    pixel_keys = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
    """(patches, grids) keys of each visual kind, concatenated over the batch's samples in order."""

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = self._rows(rows)
        text, spans, segments = self._text(rows)
        batch: dict[str, Any] = {**text, **self._token_inputs(rows, spans, text["input_ids"]), **self._media(rows)}
        self._boundaries(batch, segments)
        return batch

    def _token_inputs(
        self, rows: list[list[dict[str, Any]]], spans: list[list[tuple[int, int]]], input_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """`mm_token_type_ids` `[B, S]`: each sample's own, padded with 0."""
        token_types = torch.zeros_like(input_ids)
        for b, row in enumerate(rows):
            for sample, (start, _) in zip(row, spans[b]):
                if "mm_token_type_ids" in sample:
                    token_types[b, start : start + len(sample["input_ids"])] = torch.as_tensor(sample["mm_token_type_ids"])
        return {"mm_token_type_ids": token_types}

    def _media(self, rows: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
        """The samples' patches and grids of each visual kind concatenated in order; absent for a kind no sample has."""
        media: dict[str, torch.Tensor] = {}
        for pixels, grid in self.pixel_keys:
            samples = [sample for row in rows for sample in row if pixels in sample]
            if samples:
                media[pixels] = torch.cat([sample[pixels] for sample in samples])
                grids = [torch.as_tensor(sample[grid], dtype=torch.long).reshape(-1, 3) for sample in samples]
                media[grid] = torch.cat(grids)
        return media
