"""Qwen3.5 dense (HF `Qwen3_5ForConditionalGeneration`, e.g. Qwen3.5-9B) as model id `qwen3_5`.

The vision tower is Qwen3-VL's without DeepStack, the positions are Qwen3-VL's M-RoPE (`get_rope_index`), so the
model class mixes `Qwen3VLTrainingMixin` (`mmfsdp.model.families.qwen3_vl.model`: M-RoPE for the whole sample,
the vision placeholder of text-only micro-batches) into the HF class. What is Qwen3.5's own is the decoder: its
`text_config.layer_types` mixes

- `linear_attention` layers (three in four in the released models): Gated DeltaNet, `linear_attn` with the
  projections `in_proj_qkv` (`H → 2·K + V`), `in_proj_z` (`H → V`, the output gate), `in_proj_b` / `in_proj_a`
  (`H → value heads`, the write strength and the decay), a causal depth-wise `conv1d` over q, k, v and
  `out_proj` (`V → H`); a recurrence along the positions, with state;
- `full_attention` layers: gated grouped-query attention (`q_proj` gives the queries and their output gate).

Packing and context parallel: on, through `mmfsdp.model.gated_deltanet`. HF's torch fallback of the Gated DeltaNet
(the chunked delta rule and the causal convolution) ignores `cu_seq_lens`: a packed row would run one recurrence
over all its samples (docs/families.md, "Qwen3.5"). So the model class routes every Gated DeltaNet layer through
`use_packed_forward` when it is built (`Qwen3_5TrainingMixin.packed_linear_attention`): the layer restarts its
state and its convolution at every sample boundary (`cu_seq_lens_q`, the keyword the attention layers read too)
and, under Ulysses / Ring / Hybrid context parallel, takes the `CPContext` the decoder layers receive
(`mmfsdp.model.context_parallel.CP_CONTEXT_KEY`) and computes its shard exactly. The full-attention layers take the
usual varlen and CP attention paths. A model class that does not route them (`packed_linear_attention = False`)
refuses `cu_seq_lens` and context parallel at run time, and an entry over such a class must declare neither
`packing` nor `context_parallel`, so `--check` refuses packed rows, padding-free micro-batches and CP sizes > 1.
Padded rows are exact either way: HF zeroes the padding's inputs to the linear layers and the padding is at the
end of each row, after every real token.

Shape legend: B batch, S tokens, H hidden size, K / V all key / value heads' size of a linear layer.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from mmfsdp.model.families.qwen3_vl.model import (
    DECODER_FSDP_MODULES,
    VISION_FSDP_MODULES,
    Qwen3VLCosts,
    Qwen3VLEntry,
    Qwen3VLTestKit,
    Qwen3VLTrainingMixin,
)
from mmfsdp.model.flops import FlopShape, TowerFlops
from mmfsdp.model.gated_deltanet import use_packed_forward
from mmfsdp.model.spec import DataNames, register_model
from mmfsdp.config import warn_once
from mmfsdp.model.gated_deltanet import plan_batch_layers, resolve_gdn_kernel, set_kernel
from mmfsdp.parallel.device import detect_device_type

__all__ = [
    "Qwen3_5Costs",
    "Qwen3_5Entry",
    "Qwen3_5ForConditionalGenerationFSDP",
    "Qwen3_5TestKit",
    "Qwen3_5TrainingMixin",
    "DELTA_RULE_CHUNK",
    "gated_deltanet_layers",
    "hybrid_decoder",
    "linear_attention_params",
]

NO_PACKING = (
    "this model's Gated DeltaNet layers run HF's torch fallback, which ignores sample boundaries (cu_seq_lens) and "
    "context parallel: packed rows would leak state from one sample into the next. Use padded micro-batches "
    "(data.dataloader_param.padding_free: false, data.dataset_param.basic_parameters.packing: false) and no context "
    "parallel"
)
"""Why a packed batch or context parallel is refused by a model whose Gated DeltaNet is not routed."""


def gated_deltanet_layers(decoder: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet modules (`linear_attn`) of the decoder's `linear_attention` layers."""
    return [layer.linear_attn for layer in decoder.layers if getattr(layer, "linear_attn", None) is not None]


class Qwen3_5TrainingMixin(Qwen3VLTrainingMixin):
    """Qwen3-VL's training hooks (M-RoPE, the vision placeholder) with the Gated DeltaNet layers routed through
    the packing- and CP-exact operator (module docstring)."""

    packed_linear_attention: ClassVar[bool] = True
    """Route every Gated DeltaNet layer through `mmfsdp.model.gated_deltanet.use_packed_forward`; False keeps HF's
    forward, and the model refuses packed rows and context parallel."""

    def init_training_forward(self) -> None:
        super().init_training_forward()
        if self.packed_linear_attention:
            for module in gated_deltanet_layers(self.get_submodule(self.decoder_name)):
                use_packed_forward(module)

    def set_gdn_kernel(self, kernel: str) -> None:
        """The delta rule's implementation (`model.gdn_kernel`); "fla" where it cannot run warns once and runs torch."""
        runs, why = resolve_gdn_kernel(kernel, detect_device_type())
        if kernel == "fla" and runs != "fla":
            warn_once(f"model.gdn_kernel: fla, but {why}: the Gated DeltaNet runs its torch path")
        for module in gated_deltanet_layers(self.get_submodule(self.decoder_name)):
            set_kernel(module, kernel)

    def plan_layers(self, plan, layout) -> None:
        """The Gated DeltaNet's segments and index tensors (`mmfsdp.model.gated_deltanet.plan_batch_layers`)."""
        super().plan_layers(plan, layout)
        if self.packed_linear_attention:
            plan_batch_layers(plan, layout, self.config.text_config.linear_conv_kernel_dim)

    def prepare_inputs(self, kwargs: dict[str, Any], cu_seq_lens: torch.Tensor | None) -> dict[str, Any]:
        if cu_seq_lens is not None and not self.packed_linear_attention:
            raise ValueError(NO_PACKING)
        return super().prepare_inputs(kwargs, cu_seq_lens)

    def enable_context_parallel(self, parallel_dims: Any, *, vision_dp: bool = False) -> None:
        if not self.packed_linear_attention:
            raise ValueError(NO_PACKING)
        super().enable_context_parallel(parallel_dims, vision_dp=vision_dp)


class Qwen3_5ForConditionalGenerationFSDP(Qwen3_5TrainingMixin, Qwen3_5ForConditionalGeneration):
    """HF `Qwen3_5ForConditionalGeneration` plus the training forward, chunk loss, M-RoPE and the packed, CP-exact
    Gated DeltaNet."""

    def __init__(self, config: Qwen3_5Config):
        super().__init__(config)
        self.init_training_forward()


DELTA_RULE_CHUNK = 64
"""Positions per chunk of the chunked delta rule (HF's torch fallback and the FLA kernels alike)."""


def linear_attention_params(text_config: PretrainedConfig) -> int:
    """Multiply-adds per token of one Gated DeltaNet layer: its projections (qkv, z, b, a and out) and the chunked
    delta rule's products, per value head `2·C·dk + C·dv + 3·dk·dv` (C = `DELTA_RULE_CHUNK`: within a chunk
    `k_beta·kᵀ` and `q·kᵀ` over C keys and the attention-weighted values; three state-sized products, reading the
    state twice and writing it once). The latter is exact for rows that fill whole chunks (the kernels pad the
    last chunk and compute it whole)."""
    hidden = text_config.hidden_size
    key_dim, value_dim = text_config.linear_key_head_dim, text_config.linear_value_head_dim
    value_heads = text_config.linear_num_value_heads
    key = text_config.linear_num_key_heads * key_dim
    value = value_heads * value_dim
    projections = hidden * (2 * key + value) + 2 * hidden * value + 2 * hidden * value_heads
    chunk = DELTA_RULE_CHUNK
    delta_rule = value_heads * (2 * chunk * key_dim + chunk * value_dim + 3 * key_dim * value_dim)
    return projections + delta_rule


def hybrid_decoder(text_config: PretrainedConfig, mlp_params: int) -> TowerFlops:
    """Qwen3.5's decoder for FLOP counting: per token the projections of every layer (gated attention: q and its
    gate, k, v, o; Gated DeltaNet: projections and the delta rule, `linear_attention_params`), `mlp_params` and
    `lm_head`; the attention term (`QKᵀ`, `AV` over the causal pairs) for the full-attention layers only."""
    hidden = text_config.hidden_size
    head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
    q_dim = text_config.num_attention_heads * head_dim
    kv_dim = text_config.num_key_value_heads * head_dim
    num_full = sum(kind == "full_attention" for kind in text_config.layer_types)
    num_linear = text_config.num_hidden_layers - num_full
    full = hidden * 2 * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    return TowerFlops(
        num_layers=num_full,
        params_per_token=num_full * full + num_linear * linear_attention_params(text_config) + mlp_params,
        attention_dim=q_dim,
        causal=True,
        params_outside=hidden * text_config.vocab_size,
    )


class Qwen3_5Costs(Qwen3VLCosts):
    """The hybrid decoder (`hybrid_decoder`) and Qwen3-VL's vision tower (`Qwen3VLCosts.vision_flops`: the config
    has no DeepStack merger, so none is counted)."""

    def flop_shape(self, config: PretrainedConfig) -> FlopShape:
        text_config = config.text_config
        return FlopShape(
            decoder=hybrid_decoder(text_config, self.decoder_mlp_params(text_config)), vision=self.vision_flops(config)
        )

    def decoder_values_per_token(self, text_config: PretrainedConfig) -> float:
        """The mean over the layer mix: a full-attention layer as the default (q and its gate count twice); a
        Gated DeltaNet layer keeps its input and norm, the qkv projection before and after the convolution, z,
        the core output and its gated norm (2·(2K + V) + 3V), the recurrent state entering each chunk of the
        delta rule (`Hv · dk · dv` per `DELTA_RULE_CHUNK` tokens, kept for backward in fp32: 2 values of the
        bf16 compute dtype each), and the MLP's values."""
        hidden = text_config.hidden_size
        head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
        kv = text_config.num_key_value_heads * head_dim
        key = text_config.linear_num_key_heads * text_config.linear_key_head_dim
        value = text_config.linear_num_value_heads * text_config.linear_value_head_dim
        states = 2 * value * text_config.linear_key_head_dim / DELTA_RULE_CHUNK
        mlp = self.mlp_values_per_token(text_config)
        full = 10 + 3 * kv / hidden + mlp
        linear = 6 + (2 * (2 * key + value) + 3 * value + states) / hidden + mlp
        num_full = sum(kind == "full_attention" for kind in text_config.layer_types)
        return (num_full * full + (text_config.num_hidden_layers - num_full) * linear) / text_config.num_hidden_layers

    def mlp_values_per_token(self, text_config: PretrainedConfig) -> float:
        """Values the MLP of one layer keeps per token, in units of `hidden_size`: gate, up, silu(gate), their
        product and one more of `intermediate_size`."""
        return 5 * text_config.intermediate_size / text_config.hidden_size


class Qwen3_5TestKit(Qwen3VLTestKit):
    """Qwen3-VL's tiny configs and batches (`Qwen3VLTestKit`) with Qwen3.5's hybrid decoder and a tower without
    DeepStack; rows of 64, 50 and 41 tokens, right-padded to 64: one whole chunk of the delta rule
    (`DELTA_RULE_CHUNK`), where its FLOP count per token is exact."""

    config_class = Qwen3_5Config
    row_lengths = (64, 50, 41)

    def tiny_text_config(self) -> dict[str, Any]:
        """3 decoder layers (Gated DeltaNet, Gated DeltaNet, full attention: the released models' mix in small),
        partial rotary M-RoPE as the released configs have it (~0.25M parameters in all)."""
        return {
            **super().tiny_text_config(),
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        }

    def tiny_vision_config(self) -> dict[str, Any]:
        """Qwen3-VL's tiny tower without DeepStack mergers."""
        vision = super().tiny_vision_config()
        del vision["deepstack_visual_indexes"]
        return vision

    def same_kernels(self, reference: nn.Module) -> None:
        """HF's Gated DeltaNet layers run its torch fallback of the delta rule, which orders the same sums otherwise
        than ours (`mmfsdp.model.gated_deltanet`): the HF model's layers are routed through ours too."""
        for module in gated_deltanet_layers(reference.model.language_model):
            use_packed_forward(module)


@register_model("qwen3_5")
class Qwen3_5Entry(Qwen3VLEntry):
    """Qwen3-VL's vision tower without DeepStack + Qwen3.5's hybrid decoder (Gated DeltaNet and gated attention);
    the recompute and vision modules and the capabilities are Qwen3-VL's: packing and Ulysses / Ring / Hybrid
    context parallel through the packed Gated DeltaNet (module docstring), video as Qwen3-VL."""

    config_class = Qwen3_5Config
    model_class = Qwen3_5ForConditionalGenerationFSDP
    fsdp_modules = (*VISION_FSDP_MODULES, *DECODER_FSDP_MODULES)
    # qwen3_vl_nothink: what MindSpeed-MM's Qwen3.5 configs train with (with enable_thinking: false)
    data = DataNames(templates=("qwen3_5", "qwen3_vl_nothink"), image_plugins=("qwen3_vl",), collators=("qwen3_vl",))
    absent_modules = (("mtp", "the multi-token-prediction head is not part of HF's Qwen3.5 model class"),)
    lora_presets = {
        **Qwen3VLEntry.lora_presets,
        "gated_deltanet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    }
    """Qwen3-VL's presets and `preset:gated_deltanet`: the Gated DeltaNet projections (`linear_attn`)."""
    costs = Qwen3_5Costs()
    testkit = Qwen3_5TestKit()

    def build(self, model_cfg, features_cfg=None, **kwargs):
        """The HF family's build, then the Gated DeltaNet's delta rule as `model.gdn_kernel` says."""
        model = super().build(model_cfg, features_cfg, **kwargs)
        model.set_gdn_kernel(model_cfg.gdn_kernel)
        return model

    def kernel_lines(self, model_cfg, device_type: str) -> list[str]:
        """Which Gated DeltaNet delta rule runs (`model.gdn_kernel`), and why."""
        runs, why = resolve_gdn_kernel(model_cfg.gdn_kernel, device_type)
        ring = " (under ring context parallel: torch, which chains the ring's chunk states)" if runs == "fla" else ""
        return [f"gated deltanet kernel: {runs}{ring} ({why})"]
