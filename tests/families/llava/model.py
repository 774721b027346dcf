"""The LLaVA model class and its spec (model id `llava`).

`LlavaForConditionalGenerationFSDP` is the HF model plus the shared training forward (weighted loss, chunk loss,
varlen keywords, the vision placeholder for text-only micro-batches) — nothing of LLaVA's is forked. CLIP runs
every image at one fixed size, so its tower needs no per-image attention; its smallest input is one image.

`LlavaEntry` declares the rest: plans as module patterns, no capability beyond FSDP2 (context parallel and packing
are untested here, so `--check` refuses them), no data pieces of `mmfsdp.data` (its batches come from its test
kit), its state-dict adapter, the meta init of CLIP's non-persistent `position_ids`, its costs (`LlavaCosts`:
CLIP's FLOPs and patches) and its test kit (`LlavaTestKit`).
"""

from typing import Any

import torch
from torch import nn
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from families.llava.adapter import LlavaAdapter
from mmfsdp.model import (
    Capabilities, DataNames, FamilyCosts, FamilyTestKit, HFFamilyEntry, TrainingForwardMixin, register_model,
)
from mmfsdp.model.flops import TowerFlops

__all__ = ["LlavaCosts", "LlavaEntry", "LlavaForConditionalGenerationFSDP", "LlavaTestKit"]


class LlavaForConditionalGenerationFSDP(TrainingForwardMixin, LlavaForConditionalGeneration):
    """HF `LlavaForConditionalGeneration` plus the training forward."""

    def __init__(self, config: LlavaConfig):
        super().__init__(config)
        self.init_training_forward()

    def placeholder_vision_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """One black image at CLIP's fixed size (the tower takes no other)."""
        vision = self.config.vision_config
        shape = (1, vision.num_channels, vision.image_size, vision.image_size)
        return {"pixel_values": torch.zeros(shape, device=device, dtype=dtype)}


class LlavaCosts(FamilyCosts):
    """CLIP's vision tower and the projector: FLOPs, and the patches of each (fixed-size) image."""

    def vision_flops(self, config: LlavaConfig) -> TowerFlops:
        """CLIP layers (q, k, v, o; fc1, fc2), the patch convolution, and per image token the projector (`linear_1`,
        `linear_2`). The class token is one more position of the tower; its projector row is counted too."""
        vision, text = config.vision_config, config.text_config
        hidden, layers = vision.hidden_size, vision.num_hidden_layers
        return TowerFlops(
            num_layers=layers, params_per_token=layers * (4 * hidden * hidden + 2 * hidden * vision.intermediate_size),
            attention_dim=hidden, causal=False, params_outside=vision.num_channels * vision.patch_size**2 * hidden,
            params_per_merged_token=hidden * text.hidden_size + text.hidden_size**2,
        )

    def image_patches(self, config: LlavaConfig, batch: dict[str, torch.Tensor]) -> list[int]:
        """Every image is CLIP's fixed size: its patches and the class token."""
        pixels = batch.get("pixel_values")
        if pixels is None:
            return []
        vision = config.vision_config
        return [(vision.image_size // vision.patch_size) ** 2 + 1] * pixels.shape[0]


class LlavaTestKit(FamilyTestKit):
    """Tiny LLaVA configs and batches (`testing.llava_batch`)."""

    def tiny_config(self, *, vocab_size: int = 256, image_token_id: int = 10, **overrides: Any) -> LlavaConfig:
        """A LLaVA config of ~0.2M parameters (fp32, untied lm_head): CLIP hidden 32, 2 layers, 16x16 images of
        8x8 patches (4 image tokens); Llama hidden 64, 2 layers, 4 heads, 2 KV heads."""
        vision = CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
            num_channels=3,
            projection_dim=32,
        )
        text = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=vocab_size,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
        settings = dict(
            vision_config=vision,
            text_config=text,
            image_token_index=image_token_id,
            image_seq_length=4,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
        settings.update(overrides)
        return LlavaConfig(**settings)

    def test_batch(self, config: LlavaConfig, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """3 rows of 24, 19 and 14 tokens; with images two in the first row, one in the second, none in the last."""
        from families.llava.testing import llava_batch

        return llava_batch(config, lengths=(24, 19, 14), images_per_row=(2, 1, 0) if images else (0, 0, 0), seed=seed)


@register_model("llava")
class LlavaEntry(HFFamilyEntry):
    """CLIP vision tower + two-layer projector + Llama decoder."""

    config_class = LlavaConfig
    model_class = LlavaForConditionalGenerationFSDP
    fsdp_modules = (
        "model.vision_tower.encoder.layers.{*}",
        "model.multi_modal_projector",
        "model.language_model.embed_tokens",
        "model.language_model.layers.{*}",
        "lm_head",
    )
    recompute_modules = ("model.vision_tower.encoder.layers.{*}", "model.language_model.layers.{*}")
    vision_modules = ("model.vision_tower", "model.multi_modal_projector")
    capabilities = Capabilities()  # FSDP2 only: context parallel and packing are not tested here, so refused
    data = DataNames()  # no template, plugin or collator of mmfsdp.data fits it; its batches come from its test kit
    lora_presets = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj")}
    """`preset:attention`: Llama's attention projections and CLIP's q, k, v (CLIP's output is `out_proj`)."""
    costs = LlavaCosts()
    testkit = LlavaTestKit()

    def state_dict_adapter(self) -> LlavaAdapter:
        return LlavaAdapter()

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        """The rotary `inv_freq` (the default), and CLIP's `position_ids` `[1, num_positions]`."""
        super().init_non_persistent_buffers(model)
        embeddings = model.get_submodule("model.vision_tower.embeddings")
        positions = torch.arange(embeddings.num_positions, device=embeddings.position_ids.device)
        embeddings.position_ids.copy_(positions.expand(1, -1))
