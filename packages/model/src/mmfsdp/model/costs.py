"""`FamilyCosts`: what a family's model costs, in the numbers MFU (`mmfsdp.model.flops`) and the memory plan
(`apps/train`'s `memory.py`) need, read from its HF config.

It is a facet of the family's spec (`ModelEntry.costs`), apart from the declaration: the defaults describe a
pre-norm decoder with grouped-query attention and a gated MLP (Mistral, Qwen3) and count no vision tower; a family
subclasses it for what differs (a MoE decoder's MLP, its vision tower and how many patches each image has).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmfsdp.model.flops import FlopShape, TowerFlops, gated_decoder

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["FamilyCosts"]


class FamilyCosts:
    """The FLOP and memory figures of a family's model (module docstring); stateless, one instance per family."""

    def flop_shape(self, config: PretrainedConfig) -> FlopShape:
        """The model's towers for FLOP counting: the decoder from `config.text_config` (grouped-query attention,
        `decoder_mlp_params`, `lm_head`), the vision tower from `vision_flops` and the audio tower from `audio_flops`."""
        text_config = config.text_config
        return FlopShape(decoder=gated_decoder(text_config, self.decoder_mlp_params(text_config)),
                         vision=self.vision_flops(config), audio=self.audio_flops(config))

    def decoder_mlp_params(self, text_config: PretrainedConfig) -> int:
        """Matmul weights of the decoder's MLPs one token passes through, all layers together: by default a gated MLP
        (gate, up, down) of `intermediate_size` in every layer. MoE families count the router and top-k experts."""
        return text_config.num_hidden_layers * 3 * text_config.hidden_size * text_config.intermediate_size

    def vision_flops(self, config: PretrainedConfig) -> TowerFlops | None:
        """The vision tower and projector for FLOP counting; None: not counted (a text-only family). Families with
        a vision tower describe it."""
        return None

    def image_patches(self, config: PretrainedConfig, batch: dict[str, torch.Tensor]) -> list[int]:
        """Vision-tower patches of each image of a collated `batch` of the model of HF `config`, in order (FLOP
        counting); [] when it has none."""
        return []

    def audio_flops(self, config: PretrainedConfig) -> TowerFlops | None:
        """The audio tower for FLOP counting (per frame after its convolutions); None: the family has none."""
        return None

    def audio_windows(self, config: PretrainedConfig, batch: dict[str, torch.Tensor]) -> list[int]:
        """Frames of each attention window of the audio tower for a collated `batch`, in order; [] without audio."""
        return []

    audio_tower: str | None = None
    """The module of the audio tower, for the memory plan (whether it trains); None: the family has none."""

    def audio_values_per_token(self, config: PretrainedConfig, *, recompute: bool) -> float:
        """Values the audio tower saves for backward per decoder audio token, all its layers together (the memory
        plan; `recompute`: each layer keeps only its input, plus one layer being recomputed); 0 without a tower."""
        return 0.0

    def decoder_values_per_token(self, text_config: PretrainedConfig) -> float:
        """Values one decoder layer saves for backward per token, in units of `hidden_size` (the memory plan).

        The default is a pre-norm decoder layer with grouped-query attention and a gated MLP (Mistral, Qwen3):
        attention keeps the layer input and its norm, q, rotated q, the attention output and o_proj's input
        (8 hidden-sized with the MLP's residual, norm and down input), k, rotated k and v (3 KV-sized), and the
        MLP gate, up, silu(gate) and their product plus one more (5 MLP-sized); flash/SDPA keep no scores.
        """
        hidden = text_config.hidden_size
        head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
        kv = text_config.num_key_value_heads * head_dim
        return 8 + 3 * kv / hidden + 5 * text_config.intermediate_size / hidden

    def vision_patches_per_image_token(self, config: PretrainedConfig) -> int:
        """Vision-tower patches behind one image token of the decoder: the patch merger's `merge²`."""
        merge = getattr(config, "spatial_merge_size", None) or getattr(config.vision_config, "spatial_merge_size", 1)
        return int(merge) ** 2

    def vision_num_layers(self, config: PretrainedConfig) -> int:
        """Blocks of the vision tower (the memory plan): `vision_config.num_hidden_layers`, or `depth` as Qwen-VL
        configs name it (transformers before 5.2x has no alias between the two)."""
        vision = config.vision_config
        for name in ("num_hidden_layers", "depth"):
            value = getattr(vision, name, None)
            if value is not None:
                return int(value)
        raise AttributeError(f"{type(vision).__name__} has neither num_hidden_layers nor depth")
