"""Qwen3-Omni's test helpers: synthetic samples with images and audio clips, and batches of them, for a tiny config.

A sample is Qwen3-VL's (`qwen3_vl_sample`: prompt, images, text) with audio clips after its images, each
`<audio_start>`, one `<audio_pad>` per token the audio tower makes of its frames, `<audio_end>`; a batch is
Qwen3-VL's (`qwen3_vl_batch`) with the clips' `input_features` `[n_clips, num_mel_bins, T]` and
`feature_attention_mask` `[n_clips, T]`, in sample order and zero-padded to the longest clip, as the `qwen3_omni`
collator lays them out; videos (with or without their audio track interleaved) add `pixel_values_videos`,
`video_grid_thw` and `video_second_per_grid`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample, write_span
from mmfsdp.model.loss import IGNORE_INDEX

__all__ = ["audio_tokens", "omni_batch", "omni_sample", "tiny_full_config", "video_block"]


def audio_tokens(config: PretrainedConfig, frames: int) -> int:
    """Decoder tokens of a clip of `frames` mel frames (HF's `_get_feat_extract_output_lengths`)."""
    return int(_get_feat_extract_output_lengths(torch.tensor(frames), config.audio_config.n_window))


def video_block(config: PretrainedConfig, grid: tuple[int, int, int], track_tokens: int, seconds_per_grid: float) -> list[int]:
    """The tokens of a video of patch grid `(t, h, w)`: `<vision_start>`, its pads, `<vision_end>`; with an audio
    track of `track_tokens`, `<audio_start>`, the video and audio pads interleaved by time as the processor lays them
    (a temporal group at `t · seconds_per_grid · position_id_per_seconds`, the i-th audio pad at i) and `<audio_end>`
    inside them."""
    t, h, w = grid
    per_group = h * w // config.vision_config.spatial_merge_size**2
    video, audio = config.video_token_id, config.audio_token_id
    if not track_tokens:
        return [config.vision_start_token_id, *[video] * (t * per_group), config.vision_end_token_id]
    times = [g * seconds_per_grid * config.position_id_per_seconds for g in range(t) for _ in range(per_group)]
    ids, v, a = [], 0, 0
    while v < len(times) and a < track_tokens:
        ids.append(video if times[v] <= a else audio)
        v, a = (v + 1, a) if ids[-1] == video else (v, a + 1)
    ids += [video] * (len(times) - v) + [audio] * (track_tokens - a)
    return [config.vision_start_token_id, config.audio_start_token_id, *ids, config.audio_end_token_id,
            config.vision_end_token_id]


def omni_sample(
    config: PretrainedConfig, length: int, grids: Sequence[tuple[int, int]] = (), clips: Sequence[int] = (), *,
    videos: Sequence[tuple[int, int, int, int]] = (), seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One sample of `length` tokens: `qwen3_vl_sample`'s images (`(h, w)` patches each), then one clip of each
    of `clips` mel frames (random features), then each of `videos` `(t, h, w, track frames)` (`video_block`; 0
    frames: no audio track), one second a temporal group; labels from the end of the last medium on (-100
    before). The clips' features are in text order, the videos' tracks after the clips."""
    sample = qwen3_vl_sample(config, length, grids, seed=seed)
    if not clips and not videos:
        return sample
    merge = config.vision_config.spatial_merge_size
    at = 2 + sum(h * w // merge**2 + 2 for h, w in grids)
    input_ids, labels = sample["input_ids"], sample["labels"]
    ids = (config.audio_start_token_id, config.audio_token_id, config.audio_end_token_id)
    for frames in clips:
        at = write_span(input_ids, at, ids, audio_tokens(config, frames), f"a clip of {frames} frames")
    for t, h, w, frames in videos:
        block = video_block(config, (t, h, w), audio_tokens(config, frames) if frames else 0, 1.0)
        if at + len(block) > length:
            raise ValueError(f"a video of {len(block)} tokens does not fit in {length} tokens")
        input_ids[at : at + len(block)] = torch.tensor(block)
        at += len(block)
    labels[:at] = IGNORE_INDEX
    generator = torch.Generator().manual_seed(seed + 1000)
    if videos:
        vision = config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        sample["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w, _ in videos), patch_dim, generator=generator)
        sample["video_grid_thw"] = torch.tensor([[t, h, w] for t, h, w, _ in videos])
        sample["video_second_per_grid"] = torch.ones(len(videos))
    heard = [*clips, *(frames for *_, frames in videos if frames)]
    if heard:
        longest = max(heard)
        mels = config.audio_config.num_mel_bins
        sample["input_features"] = torch.stack(
            [F.pad(torch.randn(mels, n, generator=generator), (0, longest - n)) for n in heard]
        )
        sample["feature_attention_mask"] = torch.stack([(torch.arange(longest) < n).long() for n in heard])
    return sample


def omni_batch(
    rows: Sequence[Sequence[dict[str, torch.Tensor]]], *, seq_len: int, packing: bool = False
) -> dict[str, torch.Tensor]:
    """`qwen3_vl_batch` of `omni_sample`s plus their clips' features and masks, in sample order, padded with zeros
    (mask 0) to the longest clip."""
    batch = qwen3_vl_batch(rows, seq_len=seq_len, packing=packing)
    videos = [sample for row in rows for sample in row if "pixel_values_videos" in sample]
    for key in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid") if videos else ():
        batch[key] = torch.cat([sample[key] for sample in videos])
    clips = [sample for row in rows for sample in row if "input_features" in sample]
    if clips:
        frames = max(sample["input_features"].shape[-1] for sample in clips)
        for key in ("input_features", "feature_attention_mask"):
            batch[key] = torch.cat([F.pad(sample[key], (0, frames - sample[key].shape[-1])) for sample in clips])
    return batch


def tiny_full_config(thinker_config: PretrainedConfig) -> PretrainedConfig:
    """A full `Qwen3OmniMoeConfig` around a tiny thinker config: a one-layer MoE talker (4 experts) with a
    one-layer code predictor, and a one-layer code2wav, as small as their modules allow (for checkpoint tests)."""
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                 vocab_size=64)
    talker_text = dict(small, num_key_value_heads=1, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, rope_parameters=rope)
    talker = dict(thinker_hidden_size=thinker_config.text_config.hidden_size, text_config=talker_text,
                  code_predictor_config=dict(small, num_key_value_heads=1, num_code_groups=4), num_code_groups=4,
                  accept_hidden_layer=1, spatial_merge_size=thinker_config.vision_config.spatial_merge_size,
                  position_id_per_seconds=13)
    code2wav = dict(small, num_key_value_heads=2, codebook_size=64, num_quantizers=4, decoder_dim=32,
                    upsample_rates=[2, 2], upsampling_ratios=[2], sliding_window=8)
    del code2wav["vocab_size"], code2wav["head_dim"]
    return Qwen3OmniMoeConfig(thinker_config=thinker_config.to_dict(), talker_config=talker, code2wav_config=code2wav)
