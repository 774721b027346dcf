"""The `qwen3_omni` collator (alias `qwen3omni`, MindSpeed-MM's name).

Text, packing and images as the `qwen3_vl` collator lays them out, but no `mm_token_type_ids`: Qwen3-Omni's
processor returns none and its thinker finds media by their token ids. Audio: `input_features`
`[Σ clips, feature_size, T]` and `feature_attention_mask` `[Σ clips, T]`, the samples' clips in order, each sample's
features as its processor call gave them (`T` its longest clip's frames) and padded with zeros (mask 0) to the
batch's longest `T`; both are absent when no sample has a clip. Videos as `qwen3_vl`'s, and
`video_second_per_grid` `[Σ videos]` beside their grids. The audio encoder reads only the frames the mask
keeps, so the padding changes nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from mmfsdp.data.collators import register_collator
from mmfsdp.data.families.qwen3_vl.collator import Qwen3VLCollator

__all__ = ["Qwen3OmniCollator"]


@register_collator
class Qwen3OmniCollator(Qwen3VLCollator):
    """Qwen-VL patches and Whisper features in sample order; no token types."""

    name = "qwen3_omni"
    aliases = ("qwen3omni",)

    def _token_inputs(self, rows: Any, spans: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def _media(self, rows: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
        media = super()._media(rows)
        videos = [sample["video_second_per_grid"] for row in rows for sample in row if "video_second_per_grid" in sample]
        if videos:
            media["video_second_per_grid"] = torch.cat(videos)
        features = [clip.T for row in rows for s in row if "input_features" in s for clip in s["input_features"]]
        if features:  # [frames, feature_size] each, zero-padded at the end to the longest: [clips, feature_size, T]
            media["input_features"] = pad_sequence(features, batch_first=True).transpose(1, 2).contiguous()
            media["feature_attention_mask"] = pad_sequence(
                [mask for row in rows for s in row if "input_features" in s for mask in s["feature_attention_mask"]],
                batch_first=True)
        return media
