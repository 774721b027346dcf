"""FLOPs of a training step, counted from its real batch (for MFU and TFLOP/s in the log line).

A model family describes its towers in numbers (its spec's cost facet, `entry.costs.flop_shape(config)`: a
`FlopShape` of `TowerFlops`, read from the HF config; `mmfsdp.model.costs`) and says how many vision patches each
image of a batch has (`entry.costs.image_patches(config, batch)`); everything here is generic and names no family.

Forward FLOPs of one micro-batch, multiply-add = 2 FLOPs:

- decoder, per real token (padding excluded): `2 · params_per_token` (the matmul weights a token passes through:
  attention projections and the MLP of every layer, for a MoE layer only its router and the top-k experts, plus
  `lm_head`; embedding lookups are no matmul and are not counted). Attention, per sample of real length `n`
  (each packed sample by `cu_seq_lens`, each unpacked row by its attention mask) and per layer: `QKᵀ` and `AV`
  over the `n(n+1)/2` query-key pairs a causal mask keeps, `2 · 2 · attention_dim · n(n+1)/2`.
- vision tower, per patch: `2 · params_per_token` (patch embedding and the blocks), per merged token
  (`merge` patches) `2 · params_per_merged_token` (projector / patch mergers); attention per image of `n` patches
  and per block over all `n²` pairs, `2 · 2 · attention_dim · n²`.
- audio tower (a family that has one: `entry.costs.audio_flops`, `audio_windows`), per frame after its
  convolutions: `2 · params_per_token` (the blocks) and `2 · params_outside` (the projections in and out);
  attention per attention window of `n` frames as for a vision image. The convolutions are not counted.

A training step is 3× its forward (the backward computes the gradients of activations and of weights, 2× the
forward). That is the *model* FLOPs MFU is reported on. With activation checkpointing the recomputed blocks run
their forward once more: *hardware* FLOPs (HFU) add the forward FLOPs of the layers (decoder layers and vision
blocks, the modules of the default recompute plans) once. Frozen modules (LoRA, `model.freeze`) are counted
as trained: the figure is the model's, whatever is trained.

With FSDP2 every rank counts its own micro-batches; the trainer sums the counts over the data-parallel group
(under context parallel the ranks of a CP group hold the same batch and count it once, as the tokens are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["FlopShape", "ForwardFlops", "TowerFlops", "count_forward", "sample_lengths", "tower_forward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TowerFlops:
    """A transformer stack in the numbers FLOP counting needs."""

    num_layers: int
    """Layers (decoder layers, vision blocks): the attention term is per layer."""
    params_per_token: int
    """Matmul weights one token (one patch) passes through in all layers together; a MoE layer counts its router
    and its top-k experts only."""
    attention_dim: int
    """Query heads × head dim: the inner size of `QKᵀ` and of `AV`."""
    causal: bool
    """Causal attention (n(n+1)/2 pairs per sample) or full (n² pairs per image)."""
    params_outside: int = 0
    """Matmul weights per token outside the layers: `lm_head` (decoder), the patch embedding (vision)."""
    params_per_merged_token: int = 0
    """Vision: matmul weights per merged token (projector, patch mergers), applied once per `merge` patches."""
    merge: int = 1
    """Vision: patches per merged token (`spatial_merge_size²`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlopShape:
    """A model family's towers for FLOP counting (`FamilyCosts.flop_shape`)."""

    decoder: TowerFlops
    vision: TowerFlops | None = None
    """None for a text-only model (or one whose entry does not describe its tower)."""
    audio: TowerFlops | None = None
    """None for a model without an audio tower."""


@dataclass(frozen=True, slots=True)
class ForwardFlops:
    """Forward FLOPs of some micro-batches, split into the layers (recomputed under activation checkpointing) and
    the rest."""

    layers: int = 0
    other: int = 0

    def __add__(self, other: ForwardFlops) -> ForwardFlops:
        return ForwardFlops(self.layers + other.layers, self.other + other.other)

    @property
    def model(self) -> int:
        """Training (forward + backward) FLOPs: 3× the forward."""
        return 3 * (self.layers + self.other)

    def hardware(self, recompute: bool) -> int:
        """Training FLOPs including the recomputed forward of the layers when `recompute`."""
        return self.model + (self.layers if recompute else 0)


def tower_forward(tower: TowerFlops, lengths: Sequence[int]) -> ForwardFlops:
    """Forward FLOPs of `tower` over sequences of `lengths` tokens (samples for the decoder, images' patch counts for
    the vision tower): see the module docstring."""
    tokens = sum(lengths)
    if tower.causal:
        pairs = sum(n * (n + 1) // 2 for n in lengths)
    else:
        pairs = sum(n * n for n in lengths)
    layers = 2 * tower.params_per_token * tokens + tower.num_layers * 4 * tower.attention_dim * pairs
    merged = sum(n // tower.merge for n in lengths)
    other = 2 * tower.params_outside * tokens + 2 * tower.params_per_merged_token * merged
    return ForwardFlops(layers, other)


def count_forward(
    shape: FlopShape, sample_lens: Sequence[int], image_patches: Sequence[int], audio_windows: Sequence[int] = ()
) -> ForwardFlops:
    """Forward FLOPs of one micro-batch: its samples' real lengths, its images' patch counts and the frames of its
    audio tower's attention windows."""
    flops = tower_forward(shape.decoder, sample_lens)
    if shape.vision is not None and image_patches:
        flops = flops + tower_forward(shape.vision, image_patches)
    if shape.audio is not None and audio_windows:
        flops = flops + tower_forward(shape.audio, audio_windows)
    return flops


def sample_lengths(attention_mask: torch.Tensor, cu_seq_lens: torch.Tensor | None = None) -> list[int]:
    """Real (unpadded) length of every sample of a batch: per packed segment of `cu_seq_lens` (over the flattened
    `B·S` tokens) the tokens its attention mask keeps, else per row; segments and rows of padding only are left
    out."""
    mask = attention_mask.reshape(-1) if cu_seq_lens is not None else attention_mask
    if cu_seq_lens is None:
        lens = mask.sum(dim=-1).tolist()
    else:
        kept = torch.cat([mask.new_zeros(1), mask.cumsum(0)])
        bounds = cu_seq_lens.to(torch.long)
        lens = (kept[bounds[1:]] - kept[bounds[:-1]]).tolist()
    return [int(n) for n in lens if n > 0]


def gated_decoder(text_config: PretrainedConfig, mlp_params: int) -> TowerFlops:
    """The decoder of most families: grouped-query attention (q, k, v, o projections), an MLP of `mlp_params`
    matmul weights per token over all layers, and `lm_head`."""
    hidden = text_config.hidden_size
    num_heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // num_heads
    q_dim = num_heads * head_dim
    kv_dim = (getattr(text_config, "num_key_value_heads", None) or num_heads) * head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    num_layers = text_config.num_hidden_layers
    return TowerFlops(
        num_layers=num_layers, params_per_token=num_layers * attention + mlp_params, attention_dim=q_dim, causal=True,
        params_outside=hidden * text_config.vocab_size,
    )
