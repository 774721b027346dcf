"""Qwen3-Omni (the thinker of HF `Qwen3OmniMoeForConditionalGeneration`, e.g. Qwen3-Omni-30B-A3B) as model id
`qwen3_omni_moe`.

The family trains the thinker, HF `Qwen3OmniMoeThinkerForConditionalGeneration`: an audio tower (Whisper-style
convolutions, then encoder layers attending within windows), Qwen3-VL's vision tower with DeepStack mergers and
a Qwen3 MoE decoder with M-RoPE, under Qwen3-VL-MoE's module names. So the model class mixes Qwen3-VL-MoE's
pieces into the HF thinker (`QwenMoeModelMixin`: router load; `Qwen3VLTrainingMixin`: the DeepStack CP split,
the vision placeholder, vision DP) and adds only what Omni has on its own:

- M-RoPE positions (`prepare_inputs`): Omni's `get_rope_index` finds images and audio clips by their token ids
  (no `mm_token_type_ids`) and takes each clip's frame count (`feature_attention_mask.sum(-1)`). Without
  packing it is one call for the batch, as HF's forward makes it; with `cu_seq_lens` one call per packed sample
  with that sample's images and clips (taken in order), so positions restart at every sample: what HF gives on
  each sample alone (`omni_position_ids`).
- Audio placeholder: `media_inputs` has the kind `"audio"` (keyword `input_features`), and
  `media_placeholders` names `audio_placeholder_features`, one silent one-frame clip through the audio tower;
  a micro-batch without audio, in a run whose data holds audio, runs it right after the token embedding, where
  HF's forward merges real clips, before the vision tower (`mmfsdp.model.training_forward`, step 4), so every
  FSDP2 rank runs the audio tower's collectives, and before the vision tower's.
- Context parallel: the audio features are merged into `inputs_embeds` before the decoder, so the decoder's
  keywords are Qwen3-VL-MoE's (positions, DeepStack) and its split is `Qwen3VLTrainingMixin.split_decoder_kwargs`.
- Configs: a model directory holds the full `Qwen3OmniMoeConfig` (thinker, talker, code2wav); the family builds
  its `thinker_config` (`HFFamilyEntry.model_config`), or a bare thinker config. The talker and code2wav tensors
  are not trained and pass through conversions and exports untouched (`adapter.py`).

Videos: `prepare_inputs` passes `video_grid_thw` and `video_second_per_grid` to the positions; a video whose audio
track is interleaved with its pads (`use_audio_in_video`) is positioned by a call of its own row (`omni_position_ids`).

Shape legend: B batch, S tokens, C clips, M mel bins, T frames.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe import (
    Qwen3OmniMoeConfig, Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration,
)
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_omni
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeThinkerTextSparseMoeBlock, get_audio_cu_seqlens,
)

from mmfsdp.model.families.qwen3_vl.model import (
    DECODER_FSDP_MODULES, VISION_FSDP_MODULES, Qwen3VLEntry, Qwen3VLTrainingMixin, _take_grids, per_packed_sample,
)
from mmfsdp.model.families.qwen3_vl_moe.model import (
    Qwen3VLMoeCosts, Qwen3VLMoeTestKit, QwenMoeEntryMixin, QwenMoeModelMixin,
)
from mmfsdp.model.flops import TowerFlops
from mmfsdp.model.spec import Capabilities, DataNames, register_model
from mmfsdp.model.training_forward import vision_features

__all__ = [
    "Qwen3OmniMoeCosts",
    "Qwen3OmniMoeEntry",
    "Qwen3OmniMoeTestKit",
    "Qwen3OmniMoeThinkerForConditionalGenerationFSDP",
    "omni_position_ids",
]


def omni_position_ids(
    get_rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor,
    config: PretrainedConfig, media: dict[str, torch.Tensor | None], attention_mask: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[3, B, S]` M-RoPE positions from the thinker's `get_rope_index`: for the batch (`attention_mask`
    `[B, S]`), or per packed sample of `cu_seq_lens` (over the flattened `B·S` tokens) with that sample's media,
    taken in order: `media`'s `image_grid_thw`, `video_grid_thw`, `video_second_per_grid` `[V]` and
    `audio_lengths` `[C]` (each clip's mel frames), each None where the batch has none; a sample's padding
    continues its positions.

    A video with its audio track interleaved (`<|vision_start|><|audio_start|>`) needs `use_audio_in_video` in
    `get_rope_index`, which then misplaces a video without one: so a batch holding such a video is one call per row
    (per packed sample), each with its own flag."""
    image_grid_thw, video_grid_thw = media.get("image_grid_thw"), media.get("video_grid_thw")
    second_per_grids, audio_lengths = media.get("video_second_per_grid"), media.get("audio_lengths")
    start_ids = (config.vision_start_token_id, config.audio_start_token_id)
    # only a batch with videos can hold an interleaved track: no host read of the ids for the others
    interleaved = video_grid_thw is not None and bool(
        ((input_ids[:, :-1] == start_ids[0]) & (input_ids[:, 1:] == start_ids[1])).any()
    )
    if cu_seq_lens is None and not interleaved:
        return get_rope_index(
            input_ids, image_grid_thw, video_grid_thw, attention_mask, False, audio_lengths, second_per_grids
        )[0]
    merge = config.vision_config.spatial_merge_size
    taken = {"image": 0, "video": 0, "clip": 0}

    def positions(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        images, taken["image"] = _take_grids(image_grid_thw, taken["image"], int((ids == config.image_token_id).sum()), merge)
        first_video = taken["video"]
        videos, taken["video"] = _take_grids(video_grid_thw, first_video, int((ids == config.video_token_id).sum()), merge)
        seconds = second_per_grids[first_video : taken["video"]] if videos is not None and second_per_grids is not None else None
        first, num_clips = taken["clip"], int((ids == config.audio_start_token_id).sum())
        if num_clips and (audio_lengths is None or first + num_clips > len(audio_lengths)):
            raise ValueError(f"a sample has {num_clips} audio clips but the batch's clips run out")
        taken["clip"] += num_clips
        clips = audio_lengths[first : first + num_clips] if num_clips else None
        in_video = bool(((ids[:, :-1] == start_ids[0]) & (ids[:, 1:] == start_ids[1])).any())
        return get_rope_index(ids, images, videos, mask, in_video, clips, seconds)[0]

    if cu_seq_lens is None:
        rows = [positions(input_ids[b : b + 1], None if attention_mask is None else attention_mask[b : b + 1])
                for b in range(input_ids.shape[0])]
        # padding at 0, as the batch's one call leaves it (a row without media alone would count it on)
        return torch.cat(rows, dim=1) if attention_mask is None else torch.cat(rows, dim=1).masked_fill(attention_mask == 0, 0)
    flat_ids = input_ids.reshape(1, -1)

    def sample_positions(start: int, end: int) -> torch.Tensor:
        ids = flat_ids[:, start:end]
        return positions(ids, torch.ones_like(ids))[:, 0]

    return per_packed_sample(input_ids.shape, cu_seq_lens, sample_positions, torch.float, input_ids.device)


class Qwen3OmniMoeTrainingMixin(Qwen3VLTrainingMixin):
    """Qwen3-VL's training hooks with Omni's positions (images and audio clips by token id) and its audio kind."""

    media_inputs = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}
    media_placeholders = {"audio": "audio_placeholder_features"}

    def prepare_inputs(self, kwargs: dict[str, Any], cu_seq_lens: torch.Tensor | None) -> dict[str, Any]:
        """M-RoPE `position_ids` `[3, B, S]` for the whole sample (per packed sample), unless 3-D ones are given;
        without packing only where HF's forward computes them (with an attention mask)."""
        if not self.computes_positions(kwargs) or (cu_seq_lens is None and kwargs.get("attention_mask") is None):
            return kwargs
        input_ids = kwargs["input_ids"]
        audio_lengths = kwargs.get("audio_feature_lengths")
        if kwargs.get("feature_attention_mask") is not None:
            audio_lengths = kwargs["feature_attention_mask"].sum(-1)
        kwargs = dict(kwargs)
        media = {key: kwargs.get(key) for key in ("image_grid_thw", "video_grid_thw", "video_second_per_grid")}
        kwargs["position_ids"] = omni_position_ids(
            self.model.get_rope_index, input_ids, self.config, {**media, "audio_lengths": audio_lengths},
            kwargs.get("attention_mask") if cu_seq_lens is None else None, cu_seq_lens,
        )
        return kwargs

    def placeholder_audio_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """One silent clip of one mel frame (one token)."""
        mels = self.config.audio_config.num_mel_bins
        return {"input_features": torch.zeros(1, mels, 1, device=device, dtype=dtype),
                "feature_attention_mask": torch.ones(1, 1, device=device, dtype=torch.long),
                "audio_feature_lengths": None}

    def audio_placeholder_features(self, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The audio tower on its smallest input (`placeholder_audio_inputs`): its features."""
        return vision_features(self.get_audio_features(**self.placeholder_audio_inputs(device, dtype)))

    @staticmethod
    def _clip_frames(call: dict[str, Any]) -> torch.Tensor:
        mask = call.get("feature_attention_mask")
        return mask.sum(-1) if mask is not None else call["audio_feature_lengths"]

    def audio_media_frames(self, call: dict[str, Any]) -> list[int]:
        """Each clip's mel frames (`feature_attention_mask`, else `audio_feature_lengths`)."""
        return self._clip_frames(call).tolist()

    def audio_media_rows(self, frames: list[int]) -> list[int]:
        """Each clip's tokens out of the audio tower (HF's `_get_feat_extract_output_lengths`, on the host)."""
        lengths = torch.tensor(frames, dtype=torch.long)
        return hf_omni._get_feat_extract_output_lengths(lengths, self.config.audio_config.n_window).tolist()

    def select_audio_media(self, call: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """The clips `indices` of `input_features` `[C, M, T]` and their mask / lengths `[C, ...]`."""
        picked = torch.tensor(indices, device=call["input_features"].device)
        return {**call, **{key: call[key].index_select(0, picked.to(call[key].device))
                           for key in ("input_features", "feature_attention_mask", "audio_feature_lengths")
                           if call.get(key) is not None}}


class Qwen3OmniMoeThinkerForConditionalGenerationFSDP(
    QwenMoeModelMixin, Qwen3OmniMoeTrainingMixin, Qwen3OmniMoeThinkerForConditionalGeneration
):
    """HF `Qwen3OmniMoeThinkerForConditionalGeneration` plus the training forward (Omni's positions and audio
    placeholder, Qwen3-VL's DeepStack CP split) and `outputs.router_load`."""

    sparse_moe_block = Qwen3OmniMoeThinkerTextSparseMoeBlock


def audio_window_lengths(audio_config: PretrainedConfig, frames: torch.Tensor) -> list[int]:
    """Tokens of each attention window of the audio tower for clips of `frames` mel frames each (HF's chunks of
    `2·n_window` frames and windows of `n_window_infer` frames, `get_audio_cu_seqlens`)."""
    chunk = 2 * audio_config.n_window
    chunks = torch.ceil(frames / chunk).long()
    lengths = torch.cat([
        torch.tensor([chunk] * (int(n) - 1) + [int(f) - chunk * (int(n) - 1)]) for n, f in zip(chunks, frames)
    ])
    cu = get_audio_cu_seqlens(lengths, frames, audio_config.n_window_infer, audio_config.n_window)
    return (cu[1:] - cu[:-1]).tolist()


class Qwen3OmniMoeCosts(Qwen3VLMoeCosts):
    """Qwen3-VL-MoE's costs (the vision tower with DeepStack mergers, the sparse decoder) and the audio tower."""

    def audio_flops(self, config: PretrainedConfig) -> TowerFlops:
        """The audio encoder layers (q, k, v, out of `d_model`; fc1, fc2 of `encoder_ffn_dim`) per frame after the
        convolutions, and outside them the projection of the convolutions' output (`conv_out`) and `proj1`,
        `proj2` to the decoder's size."""
        audio = config.audio_config
        width, layers = audio.d_model, audio.encoder_layers
        freq = (((audio.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        return TowerFlops(
            num_layers=layers, params_per_token=layers * (4 * width * width + 2 * width * audio.encoder_ffn_dim),
            attention_dim=width, causal=False,
            params_outside=audio.downsample_hidden_size * freq * width + width * width + width * audio.output_dim,
        )

    audio_tower = "model.audio_tower"

    def audio_values_per_token(self, config: PretrainedConfig, *, recompute: bool) -> float:
        """One encoder position per decoder audio token: each Whisper-style layer keeps its input, norms, q, k, v,
        the attention output and residual (8 × `d_model`) and fc1's output, its GELU and fc2's input (3 ×
        `encoder_ffn_dim`); before them the three stride-2 convolutions keep their outputs and GELUs over the
        `2·n_window / tokens` mel frames behind a token, and the projections their inputs."""
        audio = config.audio_config
        width, layers = audio.d_model, audio.encoder_layers
        layer = 8 * width + 3 * audio.encoder_ffn_dim
        chunk = 2 * audio.n_window
        frames = chunk / float(hf_omni._get_feat_extract_output_lengths(torch.tensor(chunk), audio.n_window))
        channels, mels = audio.downsample_hidden_size, audio.num_mel_bins
        convs = 2 * channels * mels * frames * (1 / 4 + 1 / 16 + 1 / 64)
        freq = (((mels + 1) // 2 + 1) // 2 + 1) // 2
        outside = channels * freq + 2 * width + 2 * audio.output_dim
        return convs + outside + (layers * width + layer if recompute else layers * layer)

    def audio_windows(self, config: PretrainedConfig, batch: dict[str, torch.Tensor]) -> list[int]:
        """Tokens of each attention window of the batch's clips (`feature_attention_mask`)."""
        mask = batch.get("feature_attention_mask")
        if mask is None or batch.get("input_features") is None:
            return []
        return audio_window_lengths(config.audio_config, mask.sum(-1))


class Qwen3OmniMoeTestKit(Qwen3VLMoeTestKit):
    """Qwen3-VL-MoE's tiny decoder and vision tower with a tiny audio tower; batches with images and clips."""

    config_class = Qwen3OmniMoeThinkerConfig
    row_lengths = (40, 30, 20, 17)

    def tiny_audio_config(self) -> dict[str, Any]:
        """2 encoder layers of width 32 over 128 mel bins (the feature extractor's), HF's 100-frame chunks."""
        return dict(
            num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32, output_dim=64,
            n_window=50, n_window_infer=200, max_source_positions=64, downsample_hidden_size=8,
        )

    def tiny_config(self, *, vocab_size: int = 256, image_token_id: int = 10, **overrides: Any) -> PretrainedConfig:
        """Qwen3-VL's tiny config fields for the thinker plus `audio_config`; the audio pad, start and end tokens
        are the three ids below the image token (the samples' random text starts above the vision end token);
        `position_id_per_seconds` 13, the published checkpoints' and the processor's (transformers' config default,
        25, is Qwen2.5-Omni's)."""
        audio = {**self.tiny_audio_config(), **overrides.pop("audio_config", {})}
        ids = dict(audio_token_id=image_token_id - 3, audio_start_token_id=image_token_id - 2,
                   audio_end_token_id=image_token_id - 1, position_id_per_seconds=13)
        return super().tiny_config(vocab_size=vocab_size, image_token_id=image_token_id, audio_config=audio,
                                   **{**ids, **overrides})

    def test_batch(self, config: PretrainedConfig, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """4 rows of `row_lengths` tokens, one sample each; with `images` (and audio): two images and a clip of 60
        frames, a clip of 130 frames (two chunks), one image, text only; without, no media at all."""
        from mmfsdp.model.families.qwen3_omni_moe.testing import omni_batch, omni_sample

        media = [([(4, 4), (2, 4)], [60]), ([], [130]), ([(4, 2)], []), ([], [])] if images else [([], [])] * 4
        rows = [
            [omni_sample(config, length, grids, clips, seed=seed * 4 + b)]
            for b, (length, (grids, clips)) in enumerate(zip(self.row_lengths, media, strict=True))
        ]
        return omni_batch(rows, seq_len=max(self.row_lengths))

    def packed_test_batch(self, config: PretrainedConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """One packed row of 100 tokens: 40 with two images and a clip, 24 of text, 36 with a clip and an image."""
        from mmfsdp.model.families.qwen3_omni_moe.testing import omni_batch, omni_sample

        shapes = ((40, [(4, 4), (2, 4)], [60]), (24, [], []), (36, [(4, 2)], [130]))
        samples = [omni_sample(config, n, grids, clips, seed=seed * 3 + i) for i, (n, grids, clips) in enumerate(shapes)]
        return omni_batch([samples], seq_len=sum(n for n, _, _ in shapes), packing=True)


AUDIO_FSDP_MODULES = ("model.audio_tower.layers.{*}",)
"""The FSDP2 groups of the audio tower: its encoder layers (the convolutions and projections join the root)."""


@register_model("qwen3_omni_moe")
class Qwen3OmniMoeEntry(QwenMoeEntryMixin, Qwen3VLEntry):
    """The Qwen3-Omni thinker: audio tower, Qwen3-VL vision tower (DeepStack mergers), Qwen3 MoE decoder, M-RoPE."""

    config_class = Qwen3OmniMoeThinkerConfig
    model_class = Qwen3OmniMoeThinkerForConditionalGenerationFSDP
    fsdp_modules = (*AUDIO_FSDP_MODULES, *VISION_FSDP_MODULES, "model.visual.merger_list.{*}", *DECODER_FSDP_MODULES)
    recompute_modules = ("model.audio_tower.layers.{*}", "model.visual.blocks.{*}", "model.language_model.layers.{*}")
    vision_modules = ("model.visual", "model.audio_tower")
    """The encoders: the vision tower (first: the memory plan's) and the audio tower, replicated over context
    parallel and run whole."""
    capabilities = Capabilities(context_parallel=True, packing=True, video=True, expert_layout="hf_fused")
    legacy_module_names = (("visual", "model.visual"), ("audio_tower", "model.audio_tower"), ("model", "model.language_model"))
    """MindSpeed-MM's Qwen3-Omni configs name the modules of its own thinker class (transformers 4's layout:
    `visual`, `audio_tower`, the text model `model`); they are read in this model's names."""
    data = DataNames(templates=("qwen3_omni", "qwen3_omni_nothink"), image_plugins=("qwen3_omni",), collators=("qwen3_omni",))
    lora_presets = {
        "attention": tuple(f"model.language_model.layers.{{*}}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        "vision_attention": ("model.visual.blocks.{*}.attn.qkv", "model.visual.blocks.{*}.attn.proj"),
        "audio_attention": tuple(f"model.audio_tower.layers.{{*}}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "out_proj")),
    }
    """`preset:attention`: the decoder's attention projections (named in full: the audio layers have `q/k/v_proj`
    too); `preset:vision_attention`: the vision blocks'; `preset:audio_attention`: the audio encoder layers'."""
    costs = Qwen3OmniMoeCosts()
    testkit = Qwen3OmniMoeTestKit()

    def model_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The thinker's config of a full Qwen3-Omni `config.json`; a bare thinker config as it is."""
        return config.thinker_config if isinstance(config, Qwen3OmniMoeConfig) else config

    def state_dict_adapter(self):
        """The thinker's adapter (`adapter.Qwen3OmniMoeThinkerAdapter`): it reads both the full checkpoint's
        `thinker.*` names and a bare thinker's; exports pick theirs by the assets' `model_type`."""
        from mmfsdp.ckpt.adapters import get_state_dict_adapter

        return get_state_dict_adapter("qwen3_omni_moe_thinker")

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        """The rotary buffers, and the audio tower's sinusoidal position table (a non-persistent buffer)."""
        super().init_non_persistent_buffers(model)
        for module in model.modules():
            if hasattr(module, "compute_default_singular_positional_embedding"):
                table = module.positional_embedding
                with torch.device("cpu"):
                    module.positional_embedding = module.compute_default_singular_positional_embedding().to(table.device, table.dtype)
