"""Magistral / Mistral-Small-3.x (HF `Mistral3ForConditionalGeneration`) as model id `mistral3`.

`Mistral3ForConditionalGenerationFSDP` is the HF model plus the shared training
forward (`mmfsdp.model.training_forward`: chunk-loss `lm_head`, weighted loss,
varlen packing, context parallel) — we wrap, we don't fork. Pixtral's own
addition is the per-image attention hook on the vision tower
(`mmfsdp.model.families.mistral3.vision`): the tower flattens the patches of all images into
one sequence, and each image must attend only to itself.

`Mistral3Entry` is the family's spec: config and model classes, plans, what it
supports (context parallel, packing), its data pieces (`mistral` template,
`pixtral` plugin and collator), its costs (`Mistral3Costs`: Pixtral's FLOPs and patches) and its
test kit (`Mistral3TestKit`). Building, the parallel checks and meta init are `HFFamilyEntry`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Mistral3Config, Mistral3ForConditionalGeneration
from transformers.models.mistral3.modeling_mistral3 import Mistral3Model

from mmfsdp.model.costs import FamilyCosts
from mmfsdp.model.flops import TowerFlops
from mmfsdp.model.hf_family import HFFamilyEntry, safetensors_problem
from mmfsdp.model.spec import Capabilities, DataNames, register_model
from mmfsdp.model.testkit import FamilyTestKit
from mmfsdp.model.training_forward import TrainingForwardMixin, packed_attention_kwargs
from mmfsdp.model.families.mistral3.vision import install_per_image_attention

__all__ = [
    "Mistral3Costs", "Mistral3Entry", "Mistral3ForConditionalGenerationFSDP", "Mistral3TestKit",
    "packed_attention_kwargs", "safetensors_problem",
]


def _placeholder_image(num_channels: int, side: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One black image of two merged tokens (`side` pixels: patch size × spatial merge)."""
    return {
        "pixel_values": torch.zeros(1, num_channels, side, 2 * side, device=device, dtype=dtype),
        "image_sizes": torch.tensor([[side, 2 * side]], device=device),
    }


def _one_token_padded(pixel_values: torch.Tensor, sizes: torch.Tensor, side: int):
    """`pixel_values` and `image_sizes` with the placeholder image after them when the images hold one merged
    token in all (HF's feature split squeezes away the token dim of a one-token call); else unchanged."""
    if int(((sizes // side).prod(-1)).sum()) != 1:
        return pixel_values, sizes
    extra = _placeholder_image(pixel_values.shape[1], side, pixel_values.device, pixel_values.dtype)
    extra_pixels, extra_size = extra["pixel_values"], extra["image_sizes"].to(sizes.device, sizes.dtype)
    height = max(pixel_values.shape[-2], extra_pixels.shape[-2])
    width = max(pixel_values.shape[-1], extra_pixels.shape[-1])
    padded = pixel_values.new_zeros(len(sizes) + 1, pixel_values.shape[1], height, width)
    padded[: len(sizes), :, : pixel_values.shape[-2], : pixel_values.shape[-1]] = pixel_values
    padded[-1:, :, : extra_pixels.shape[-2], : extra_pixels.shape[-1]] = extra_pixels
    return padded, torch.cat([sizes, extra_size])


class _OneTokenSafeMistral3Model(Mistral3Model):
    """HF's `Mistral3Model` whose `get_image_features` also takes images of one merged token in all (a
    micro-batch whose only image is 16x16 at patch 8, merge 2): the placeholder image goes after them
    (`_one_token_padded`) and its features are dropped, so every call returns one `[tokens, hidden]` per image.
    The same mechanism serves vision DP's one-token shares (`select_vision_media` only cuts)."""

    def get_image_features(self, pixel_values, image_sizes, vision_feature_layer=None, **kwargs):
        num_images = len(image_sizes)
        side = self.vision_tower.patch_size * self.config.spatial_merge_size
        sizes = torch.as_tensor(image_sizes, device=pixel_values.device)
        pixel_values, sizes = _one_token_padded(pixel_values, sizes, side)
        output = super().get_image_features(
            pixel_values=pixel_values, image_sizes=sizes, vision_feature_layer=vision_feature_layer, **kwargs
        )
        if len(sizes) > num_images:
            if not hasattr(output, "pooler_output"):  # older transformers return the per-image tuple itself
                return tuple(output)[:num_images]
            output.pooler_output = tuple(output.pooler_output)[:num_images]
        return output


class Mistral3ForConditionalGenerationFSDP(TrainingForwardMixin, Mistral3ForConditionalGeneration):
    """HF `Mistral3ForConditionalGeneration` plus the training forward, chunk loss and per-image vision attention."""

    def __init__(self, config: Mistral3Config):
        super().__init__(config)
        self.model.__class__ = _OneTokenSafeMistral3Model
        install_per_image_attention(self.model.vision_tower)
        self.init_training_forward()

    def placeholder_vision_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """One black image of two merged tokens (`2 · spatial_merge_size²` patches)."""
        vision = self.config.vision_config
        side = vision.patch_size * self.config.spatial_merge_size
        return _placeholder_image(vision.num_channels, side, device, dtype)

    def vision_media_patches(self, call: dict[str, Any]) -> list[int]:
        """Patches of each image of `image_sizes` (`pixel_values` is padded to the largest image)."""
        patch = self.config.vision_config.patch_size
        return [int(h) // patch * (int(w) // patch) for h, w in call["image_sizes"].tolist()]

    def select_vision_media(self, call: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """Those images of `pixel_values` and `image_sizes` (Pixtral crops each image to its size; a selection of
        one merged token is handled by `get_image_features` itself)."""
        pixel_values = call["pixel_values"][torch.tensor(indices, device=call["pixel_values"].device)]
        return {**call, "pixel_values": pixel_values, "image_sizes": call["image_sizes"][indices]}


class Mistral3Costs(FamilyCosts):
    """Pixtral's vision tower: its FLOPs and the patches of each image."""

    def vision_flops(self, config: Mistral3Config) -> TowerFlops:
        """Pixtral blocks (q, k, v, o of the hidden size; gated MLP), the patch convolution, and per merged token
        the projector: patch merger (`merge²·d → d`), `linear_1`, `linear_2`."""
        vision, text = config.vision_config, config.text_config
        hidden, layers = vision.hidden_size, vision.num_hidden_layers
        feature_layers = 1 if isinstance(config.vision_feature_layer, int) else len(config.vision_feature_layer)
        merge = config.spatial_merge_size**2
        return TowerFlops(
            num_layers=layers, params_per_token=layers * (4 * hidden * hidden + 3 * hidden * vision.intermediate_size),
            attention_dim=vision.num_attention_heads * (vision.head_dim or hidden // vision.num_attention_heads),
            causal=False, params_outside=vision.num_channels * vision.patch_size**2 * hidden,
            params_per_merged_token=merge * hidden * hidden + hidden * feature_layers * text.hidden_size
            + text.hidden_size**2,
            merge=merge,
        )

    def image_patches(self, config: Mistral3Config, batch: dict[str, torch.Tensor]) -> list[int]:
        """From `image_sizes` (height, width in pixels; `pixel_values` is padded to the largest image)."""
        sizes = batch.get("image_sizes")
        if sizes is None:
            return []
        patch = config.vision_config.patch_size
        return [int(h) // patch * (int(w) // patch) for h, w in sizes.tolist()]


class Mistral3TestKit(FamilyTestKit):
    """Tiny Mistral3 configs and batches (`testing.tiny_batch`)."""

    def same_kernels(self, reference: nn.Module) -> None:
        """HF's Pixtral tower attends over all patches of a batch with a dense block mask; ours attends per image
        (`vision.install_per_image_attention`): the HF model gets the same per-image calls."""
        install_per_image_attention(reference.model.vision_tower)

    def test_batch(self, config: Mistral3Config, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """`testing.tiny_batch`: 3 rows of 32 tokens (two padded); with images, one in each of the
        first two rows (32x32 and 16x48), none in the last."""
        from mmfsdp.model.families.mistral3.testing import tiny_batch

        sizes = ((32, 32), (16, 48)) if images else ()
        return tiny_batch(config, batch_size=3, image_sizes=sizes, lengths=(32, 27, 19), seed=seed)

    def tiny_config(self, *, vocab_size: int = 256, image_token_index: int = 10, **overrides: Any) -> Mistral3Config:
        """A Mistral3 config of ~0.1M parameters for tests and examples (fp32, untied lm_head).

        `text_config` / `vision_config` overrides are dicts merged into the tiny
        defaults; other keywords are top-level `Mistral3Config` fields.
        """
        text = dict(
            model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=1024,
            rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False,
        )
        vision = dict(
            model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            head_dim=16, patch_size=8, image_size=64, num_channels=3, hidden_act="silu",
        )
        text.update(overrides.pop("text_config", {}))
        vision.update(overrides.pop("vision_config", {}))
        settings = dict(
            text_config=text, vision_config=vision, image_token_index=image_token_index, spatial_merge_size=2,
            projector_hidden_act="gelu", multimodal_projector_bias=False, tie_word_embeddings=False,
        )
        settings.update(overrides)
        return Mistral3Config(**settings)


@register_model("mistral3")
class Mistral3Entry(HFFamilyEntry):
    """Pixtral vision tower + patch-merging projector + Mistral decoder."""

    config_class = Mistral3Config
    model_class = Mistral3ForConditionalGenerationFSDP
    fsdp_modules = (
        "model.vision_tower.transformer.layers.{*}",
        "model.multi_modal_projector",
        "model.language_model.embed_tokens",
        "model.language_model.layers.{*}",
        "lm_head",
    )
    recompute_modules = ("model.vision_tower.transformer.layers.{*}", "model.language_model.layers.{*}")
    vision_modules = ("model.vision_tower", "model.multi_modal_projector")
    capabilities = Capabilities(context_parallel=True, packing=True)
    data = DataNames(templates=("mistral",), image_plugins=("pixtral",), collators=("pixtral",))
    lora_presets = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj")}
    """`preset:attention`: the decoder's and Pixtral's attention projections (Pixtral's are named alike)."""
    costs = Mistral3Costs()
    testkit = Mistral3TestKit()
