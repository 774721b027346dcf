"""Qwen3-VL dense (HF `Qwen3VLForConditionalGeneration`) as model id `qwen3_vl`.

`Qwen3VLForConditionalGenerationFSDP` is the HF model plus the shared training
forward (`mmfsdp.model.training_forward`). What is Qwen3-VL's own:

- Vision attention per image: the HF tower flattens the patches of all images
  (`pixel_values` `[Σ t·h·w, C·T·P·P]`) and builds its attention lengths from
  `image_grid_thw` itself, one sequence per frame, so images never attend to
  each other — nothing to add (the decoder's varlen lengths reach only the
  decoder, `TrainingForwardMixin` sees to that).
- M-RoPE positions (`prepare_inputs`): `position_ids` `[3, B, S]` (temporal,
  height, width) come from the model's own `get_rope_index`, computed on the
  whole sample before any context-parallel split. Without packing that is one
  call for the batch (padding excluded by `attention_mask`, as HF does); with
  `cu_seq_lens` it is one call per packed sample, with that sample's images,
  so every sample's positions restart. `mm_token_type_ids` (0 text, 1 image,
  2 video) are taken from the batch or derived from the image / video token ids.
- DeepStack: the decoder receives `visual_pos_masks` `[B, S]` and
  `deepstack_visual_embeds` (one `[num_visual_tokens, H]` per deepstack layer,
  rows in the order of the mask's True positions), which it adds to the hidden
  states of the visual tokens after its first layers.
- Context parallel (`split_decoder_kwargs`): positions are split along their
  last dim (`split_mrope_position_ids`), the mask along S, and every deepstack
  tensor is cut to this rank's visual tokens in this rank's order
  (`split_visual_embeds`); the rest follows `split_sequence_kwargs`. The vision
  tower and the merge run whole on every rank, so the deepstack features of a
  visual token are the same whichever rank holds the token.

Shape legend: B batch, S tokens, H hidden size, N visual tokens.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import PretrainedConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from mmfsdp.model.context_parallel import CPBatch, split_sequence_kwargs
from mmfsdp.model.costs import FamilyCosts
from mmfsdp.model.flops import TowerFlops
from mmfsdp.model.hf_family import HFFamilyEntry
from mmfsdp.model.loss import sample_starts
from mmfsdp.model.spec import Capabilities, DataNames, register_model
from mmfsdp.model.testkit import FamilyTestKit
from mmfsdp.model.training_forward import TrainingForwardMixin

__all__ = [
    "Qwen3VLForConditionalGenerationFSDP",
    "Qwen3VLTrainingMixin",
    "Qwen3VLCosts",
    "Qwen3VLEntry",
    "Qwen3VLTestKit",
    "DECODER_FSDP_MODULES",
    "VISION_FSDP_MODULES",
    "mm_token_types",
    "mrope_position_ids",
    "per_packed_sample",
    "split_mrope_position_ids",
    "split_visual_embeds",
]

_TEXT, _IMAGE, _VIDEO = 0, 1, 2


def mm_token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """`mm_token_type_ids` as the HF processor makes them: 0 text, 1 image token, 2 video token."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == image_token_id] = _IMAGE
    types[input_ids == video_token_id] = _VIDEO
    return types


def _take_grids(grids: torch.Tensor | None, start: int, num_tokens: int, merge: int) -> tuple[torch.Tensor | None, int]:
    """The grids from `start` on whose token counts (`t·h·w / merge²` each) add up to `num_tokens`; the next start."""
    end, taken = start, 0
    while taken < num_tokens:
        if grids is None or end >= len(grids):
            raise ValueError(f"the packed sample has {num_tokens} visual tokens but the grids run out after {taken}")
        taken += int(grids[end].prod()) // merge**2
        end += 1
    if taken != num_tokens:
        raise ValueError(f"a packed sample's {num_tokens} visual tokens do not fill whole images (grids give {taken})")
    return (grids[start:end] if end > start else None), end


def mrope_position_ids(
    get_rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    *,
    spatial_merge_size: int,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[3, B, S]` M-RoPE positions from the model's `get_rope_index`: for the batch, or per packed sample.

    With `cu_seq_lens` (over the flattened `B·S` tokens) each sample is one call with its
    own images and videos (taken in order), so positions restart at every sample;
    `attention_mask` is then not used (a sample's padding continues its positions).
    """
    if cu_seq_lens is None:
        return get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, attention_mask=attention_mask
        )[0]
    flat_ids, flat_types = input_ids.reshape(1, -1), mm_token_type_ids.reshape(1, -1)
    taken = {"image": 0, "video": 0}

    def sample_positions(start: int, end: int) -> torch.Tensor:
        types = flat_types[:, start:end]
        images, taken["image"] = _take_grids(image_grid_thw, taken["image"], int((types == _IMAGE).sum()), spatial_merge_size)
        videos, taken["video"] = _take_grids(video_grid_thw, taken["video"], int((types == _VIDEO).sum()), spatial_merge_size)
        return get_rope_index(flat_ids[:, start:end], types, image_grid_thw=images, video_grid_thw=videos)[0][:, 0]

    return per_packed_sample(input_ids.shape, cu_seq_lens, sample_positions, input_ids.dtype, input_ids.device)


def per_packed_sample(
    shape: torch.Size, cu_seq_lens: torch.Tensor, sample_positions: Callable[[int, int], torch.Tensor],
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """`[3, B, S]` positions of a packed batch of `shape` `(B, S)`, made one packed sample of `cu_seq_lens` (over
    the flattened `B·S` tokens) at a time, in order: `sample_positions(start, end)` gives that sample's `[3, n]`."""
    B, S = shape
    positions = torch.zeros(3, B * S, dtype=dtype, device=device)
    starts = sample_starts((B * S,), cu_seq_lens, device).nonzero().squeeze(1).tolist()
    for start, end in zip(starts, [*starts[1:], B * S]):
        positions[:, start:end] = sample_positions(start, end)
    return positions.reshape(3, B, S)


def split_mrope_position_ids(position_ids: torch.Tensor, batch: CPBatch) -> torch.Tensor:
    """This CP rank's positions of `[R, B, S]` M-RoPE ids (R = 3, or 4 with text positions first), along S."""
    return batch.split(position_ids, seq_dim=2)


def split_visual_embeds(
    visual_pos_masks_BS: torch.Tensor, embeds_NH: list[torch.Tensor], batch: CPBatch
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This CP rank's visual mask and, of each `[N, H]` tensor (rows in the mask's row-major order),
    the rows of this rank's visual tokens, in this rank's token order."""
    index_BS = (visual_pos_masks_BS.reshape(-1).to(torch.int64).cumsum(0) - 1).reshape(visual_pos_masks_BS.shape)
    local_mask = batch.split(visual_pos_masks_BS)
    local_index = batch.split(index_BS)[local_mask]
    return local_mask, [embeds.index_select(0, local_index.to(embeds.device)) for embeds in embeds_NH]


class Qwen3VLTrainingMixin(TrainingForwardMixin):
    """The training forward with Qwen3-VL's input hooks (M-RoPE per packed sample, DeepStack CP split); the
    dense and the MoE model classes mix it into their HF class."""

    media_inputs = {"image": "pixel_values", "video": "pixel_values_videos"}

    @staticmethod
    def computes_positions(kwargs: dict[str, Any]) -> bool:
        """Whether `prepare_inputs` makes the M-RoPE positions: from ids, unless 3-D ones are given or a cache is
        (generation continues HF's own)."""
        position_ids = kwargs.get("position_ids")
        if kwargs.get("input_ids") is None or (position_ids is not None and position_ids.dim() == 3):
            return False
        return kwargs.get("cache") is None and kwargs.get("past_key_values") is None

    def prepare_inputs(self, kwargs: dict[str, Any], cu_seq_lens: torch.Tensor | None) -> dict[str, Any]:
        """M-RoPE `position_ids` `[3, B, S]` for the whole sample (per packed sample), unless 3-D ones are given."""
        if not self.computes_positions(kwargs):
            return kwargs
        input_ids = kwargs["input_ids"]
        types = kwargs.get("mm_token_type_ids")
        if types is None:
            types = mm_token_types(input_ids, self.config.image_token_id, self.config.video_token_id)
        kwargs = dict(kwargs)
        kwargs["position_ids"] = mrope_position_ids(
            self.model.get_rope_index,
            input_ids,
            types,
            spatial_merge_size=self.config.vision_config.spatial_merge_size,
            image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"),
            attention_mask=kwargs.get("attention_mask") if cu_seq_lens is None else None,
            cu_seq_lens=cu_seq_lens,
        )
        return kwargs

    def placeholder_vision_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """One black single-frame image of `spatial_merge_size`² patches: one merged visual token."""
        vision = self.config.vision_config
        merge = vision.spatial_merge_size
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return {
            "pixel_values": torch.zeros(merge * merge, patch_dim, device=device, dtype=dtype),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
        }

    def vision_media_patches(self, call: dict[str, Any]) -> list[int]:
        """`t·h·w` of each image (or video) of `image_grid_thw`."""
        return call["image_grid_thw"].prod(-1).tolist()

    def select_vision_media(self, call: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """The flattened patch rows of those images (`pixel_values` holds each image's `t·h·w` rows in turn)."""
        grids = call["image_grid_thw"]
        ends = grids.prod(-1).cumsum(0).tolist()
        rows = [torch.arange(ends[i] - int(grids[i].prod()), ends[i]) for i in indices]
        pixel_values = call["pixel_values"]
        picked = pixel_values.index_select(0, torch.cat(rows).to(pixel_values.device))
        return {**call, "pixel_values": picked, "image_grid_thw": grids[indices]}

    def split_decoder_kwargs(self, kwargs: dict[str, Any], batch: CPBatch) -> dict[str, Any]:
        """M-RoPE positions along their last dim, deepstack features to this rank's visual tokens, the rest along S."""
        kwargs = dict(kwargs)
        position_ids = kwargs.get("position_ids")
        mrope = position_ids is not None and position_ids.dim() == 3
        if mrope:
            del kwargs["position_ids"]
        visual_pos_masks = kwargs.pop("visual_pos_masks", None)
        deepstack = kwargs.pop("deepstack_visual_embeds", None)
        out = split_sequence_kwargs(kwargs, batch)
        if mrope:
            out["position_ids"] = split_mrope_position_ids(position_ids, batch)
        if visual_pos_masks is not None:
            out["visual_pos_masks"], out["deepstack_visual_embeds"] = split_visual_embeds(visual_pos_masks, deepstack or [], batch)
        return out


class Qwen3VLForConditionalGenerationFSDP(Qwen3VLTrainingMixin, Qwen3VLForConditionalGeneration):
    """HF `Qwen3VLForConditionalGeneration` plus the training forward, chunk loss, M-RoPE under packing and the CP split."""

    def __init__(self, config: Qwen3VLConfig):
        super().__init__(config)
        self.init_training_forward()


class Qwen3VLCosts(FamilyCosts):
    """The Qwen3-VL vision tower (with DeepStack mergers): its FLOPs and the patches of each image and video."""

    def vision_flops(self, config: PretrainedConfig) -> TowerFlops:
        """Qwen3-VL vision blocks (fused qkv and proj of the hidden size; MLP fc1, fc2), the 3-D patch convolution,
        and per merged token the merger and each DeepStack merger the config has (`deepstack_visual_indexes`; none
        in Qwen3.5's tower) (fc1 `merge²·d → merge²·d`, fc2 to the decoder's size)."""
        vision = config.vision_config
        hidden, layers = vision.hidden_size, self.vision_num_layers(config)
        merge = vision.spatial_merge_size**2
        merger = (merge * hidden) ** 2 + merge * hidden * vision.out_hidden_size
        num_mergers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or ())
        return TowerFlops(
            num_layers=layers, params_per_token=layers * (4 * hidden * hidden + 2 * hidden * vision.intermediate_size),
            attention_dim=hidden, causal=False,
            params_outside=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * hidden,
            params_per_merged_token=num_mergers * merger, merge=merge,
        )

    def image_patches(self, config: Qwen3VLConfig, batch: dict[str, torch.Tensor]) -> list[int]:
        """`t·h·w` of each row of `image_grid_thw`, then `h·w` for each temporal patch of each row of
        `video_grid_thw`: each image, and each temporal patch of a video, attends to its own patches."""
        images, videos = batch.get("image_grid_thw"), batch.get("video_grid_thw")
        patches = [int(t) * int(h) * int(w) for t, h, w in images.tolist()] if images is not None else []
        for t, h, w in videos.tolist() if videos is not None else []:
            patches += [int(h) * int(w)] * int(t)
        return patches


class Qwen3VLTestKit(FamilyTestKit):
    """Tiny Qwen3-VL configs and batches (`testing.qwen3_vl_batch`); the Qwen3-VL MoE and Qwen3.5 kits build on it
    by their config class, tiny sub-configs and row lengths."""

    config_class: type[PretrainedConfig] = Qwen3VLConfig
    """The config class `tiny_config` makes."""
    row_lengths: tuple[int, ...] = (30, 24, 17)
    """Tokens of each row of `test_batch` (one sample a row), right-padded to the longest."""

    def tiny_text_config(self) -> dict[str, Any]:
        """The tiny decoder's `text_config` fields: 2 layers of hidden size 64, 4 heads (2 key-value), M-RoPE."""
        return dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        )

    def tiny_vision_config(self) -> dict[str, Any]:
        """The tiny vision tower's `vision_config` fields: 2 blocks of hidden size 32, a DeepStack merger after each."""
        return dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, in_channels=3, out_hidden_size=64, num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        )

    def test_batch(self, config: PretrainedConfig, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """`testing.qwen3_vl_batch`: 3 rows of 1 sample each (`row_lengths` tokens, right-padded), with
        the processor's `mm_token_type_ids`; with images, two of different sizes in the first row, one in the
        second, none in the last."""
        from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample

        grids = [[(4, 4), (2, 4)], [(4, 2)], []] if images else [[], [], []]
        rows = [
            [qwen3_vl_sample(config, length, row_grids, seed=seed * 3 + b)]
            for b, (length, row_grids) in enumerate(zip(self.row_lengths, grids, strict=True))
        ]
        batch = qwen3_vl_batch(rows, seq_len=max(self.row_lengths))
        batch["mm_token_type_ids"] = mm_token_types(batch["input_ids"], config.image_token_id, config.video_token_id)
        return batch

    def packed_test_batch(self, config: Qwen3VLConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """One packed row of 100 tokens: 40 with two images (4x4 and 2x4 patches), 24 of text, 36 with one (4x2)."""
        from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample

        shapes = ((40, [(4, 4), (2, 4)]), (24, []), (36, [(4, 2)]))
        samples = [qwen3_vl_sample(config, n, grids, seed=seed * 3 + i) for i, (n, grids) in enumerate(shapes)]
        return qwen3_vl_batch([samples], seq_len=sum(n for n, _ in shapes), packing=True)

    def tiny_config(self, *, vocab_size: int = 256, image_token_id: int = 10, **overrides: Any) -> PretrainedConfig:
        """A config of the kit's `config_class` from `tiny_text_config` and `tiny_vision_config`, for tests and
        examples (fp32, untied lm_head; ~0.2M parameters for Qwen3-VL).

        `text_config` / `vision_config` overrides are dicts merged into the tiny
        defaults; other keywords are top-level config fields. The video,
        vision-start and vision-end tokens follow the image token id.
        """
        text = {**self.tiny_text_config(), "vocab_size": vocab_size, **overrides.pop("text_config", {})}
        vision = {**self.tiny_vision_config(), **overrides.pop("vision_config", {})}
        settings = dict(
            text_config=text, vision_config=vision, image_token_id=image_token_id, video_token_id=image_token_id + 1,
            vision_start_token_id=image_token_id + 2, vision_end_token_id=image_token_id + 3, tie_word_embeddings=False,
        )
        settings.update(overrides)
        return self.config_class(**settings)


VISION_FSDP_MODULES = ("model.visual.blocks.{*}", "model.visual.merger")
"""The FSDP2 groups of the vision tower without its DeepStack mergers (Qwen3.5's tower is this one)."""
DECODER_FSDP_MODULES = ("model.language_model.embed_tokens", "model.language_model.layers.{*}", "lm_head")
"""The FSDP2 groups of the decoder and the output projection."""


@register_model("qwen3_vl")
class Qwen3VLEntry(HFFamilyEntry):
    """Qwen3-VL vision tower (with DeepStack mergers) + Qwen3 decoder with M-RoPE."""

    config_class = Qwen3VLConfig
    model_class = Qwen3VLForConditionalGenerationFSDP
    fsdp_modules = (*VISION_FSDP_MODULES, "model.visual.deepstack_merger_list.{*}", *DECODER_FSDP_MODULES)
    recompute_modules = ("model.visual.blocks.{*}", "model.language_model.layers.{*}")
    vision_modules = ("model.visual",)
    capabilities = Capabilities(context_parallel=True, packing=True, video=True)
    data = DataNames(templates=("qwen3_vl", "qwen3_vl_nothink"), image_plugins=("qwen3_vl",), collators=("qwen3_vl",))
    lora_presets = {
        "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "vision_attention": ("model.visual.blocks.{*}.attn.qkv", "model.visual.blocks.{*}.attn.proj"),
    }
    """`preset:attention`: the decoder's attention projections; `preset:vision_attention`: the vision blocks'."""
    costs = Qwen3VLCosts()
    testkit = Qwen3VLTestKit()
