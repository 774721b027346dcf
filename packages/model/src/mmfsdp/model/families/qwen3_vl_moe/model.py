"""Qwen3-VL MoE (HF `Qwen3VLMoeForConditionalGeneration`, e.g. Qwen3-VL-30B-A3B) as model id `qwen3_vl_moe`.

The vision tower, DeepStack, M-RoPE and the decoder's attention are Qwen3-VL's,
so the model class mixes the same `Qwen3VLTrainingMixin` into the HF class
(`mmfsdp.model.families.qwen3_vl.model`: M-RoPE per packed sample, the DeepStack CP split; the
tower already attends per image). What the MoE adds:

- Sparse MLP blocks: `model.language_model.layers.{*}.mlp` is a
  `Qwen3VLMoeTextSparseMoeBlock` with a router `gate` (`[E, H]`, softmax, top-k,
  renormalised) and `experts`, whose weights are fused tensors
  `gate_up_proj` `[E, 2·I, H]` (gate rows first) and `down_proj` `[E, H, I]`.
  The entry names the expert modules (`expert_modules`) for expert parallel and
  the routers (`router_modules`); the default FSDP plan wraps whole decoder
  layers, experts included, as for the dense model.
- Router statistics: the training forward (with `loss_weights`) also returns
  `outputs.router_load` (`mmfsdp.model.router.RouterLoad`: per layer and expert,
  top-k assignments and summed router probabilities of this rank's tokens, padding
  excluded), from which `load_balancing_loss` gives HF's unscaled `aux_loss` and
  `expert_load_summary` the load statistics. The LM loss `outputs.loss` is
  unchanged; the spec's `step_terms` (`RouterStepTerms`) adds
  `features.loss_cfg.router_aux_loss_coef × aux` to each micro-batch's loss and
  reports the aux loss and expert load of the step (`entry.router_aux_loss_coef(config)`
  is the checkpoint's own coefficient).
- Checkpoints: `adapter.Qwen3VLMoeAdapter` reads the hub's fused
  layout, transformers 5's `save_pretrained` layout and per-expert exports.

What the two Qwen MoE families (`qwen3_vl_moe`, `qwen3_5_moe`) share is here, once: `QwenMoeModelMixin` (the model
class's `__init__`: the training forward, then the router recorder over every sparse block) and
`QwenMoeEntryMixin` (the expert and router patterns, `num_experts`, `step_terms`, `routed_mlp_params`); each
is mixed in first, before the dense family's model class or spec.

Shape legend: B batch, S tokens, H hidden size, E experts, I expert intermediate size, L MoE layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn
from transformers import PretrainedConfig, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from mmfsdp.model.families.qwen3_vl.model import Qwen3VLCosts, Qwen3VLEntry, Qwen3VLTestKit, Qwen3VLTrainingMixin
from mmfsdp.model.router import RouterLoadForward, RouterStepTerms
from mmfsdp.model.spec import register_model

if TYPE_CHECKING:
    from mmfsdp.model.config import LossConfig

__all__ = [
    "Qwen3VLMoeCosts",
    "Qwen3VLMoeEntry",
    "Qwen3VLMoeForConditionalGenerationFSDP",
    "Qwen3VLMoeTestKit",
    "QwenMoeEntryMixin",
    "QwenMoeModelMixin",
    "routed_mlp_params",
]


class QwenMoeModelMixin(RouterLoadForward):
    """A Qwen MoE model class's first base (before the family's training mixin and the HF class): builds the HF
    model, its training forward, then the router recorder over every `sparse_moe_block` (`RouterLoadForward`:
    `outputs.router_load`)."""

    sparse_moe_block: ClassVar[type[nn.Module]]
    """The HF sparse MLP block class, whose router is its `gate`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.init_training_forward()
        self.init_router_load(self.sparse_moe_block, top_k=config.text_config.num_experts_per_tok)


class QwenMoeEntryMixin:
    """A Qwen MoE spec's first base (before the dense family's spec): the sparse block `mlp` of the decoder layers,
    its fused experts for expert parallel and its router, whose load-balancing loss joins each step. The
    capabilities are the dense spec's with the experts' layout (`expert_layout`) added."""

    expert_layout: ClassVar[str] = "hf_fused"
    """The layout of the fused experts (`mmfsdp.parallel.expert_parallel.EXPERT_LAYOUTS`)."""

    expert_modules = ("model.language_model.layers.{*}.mlp.experts",)
    """The fused routed experts (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`): what expert parallel
    shards along E."""
    router_modules = ("model.language_model.layers.{*}.mlp.gate",)
    """The routers (`weight` `[E, H]`), replicated over expert parallel."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" not in vars(cls):
            cls.capabilities = replace(cls.capabilities, expert_layout=cls.expert_layout)

    def num_experts(self, config: PretrainedConfig) -> int:
        return int(config.text_config.num_experts)

    def step_terms(self, loss_cfg: LossConfig) -> RouterStepTerms:
        """The router load-balancing loss (× `router_aux_loss_coef`) and the expert load of each step."""
        return RouterStepTerms(loss_cfg.router_aux_loss_coef)


def routed_mlp_params(text_config: PretrainedConfig) -> int:
    """Multiply-adds per token of one sparse block's router (`H·E`) and top-k routed experts (gate, up, down of
    `moe_intermediate_size` each)."""
    hidden = text_config.hidden_size
    experts = text_config.num_experts_per_tok * 3 * hidden * text_config.moe_intermediate_size
    return hidden * text_config.num_experts + experts


class Qwen3VLMoeForConditionalGenerationFSDP(
    QwenMoeModelMixin, Qwen3VLTrainingMixin, Qwen3VLMoeForConditionalGeneration
):
    """HF `Qwen3VLMoeForConditionalGeneration` plus the Qwen3-VL training forward and `outputs.router_load`."""

    sparse_moe_block = Qwen3VLMoeTextSparseMoeBlock


class Qwen3VLMoeCosts(Qwen3VLCosts):
    """Qwen3-VL's costs with a sparse decoder: per token the router and the top-k experts."""

    def decoder_mlp_params(self, text_config: PretrainedConfig) -> int:
        """Per sparse layer the router and the top-k experts (`routed_mlp_params`); a layer in `mlp_only_layers`
        or off the `decoder_sparse_step` has the dense MLP (HF's rule)."""
        sparse = routed_mlp_params(text_config)
        dense = 3 * text_config.hidden_size * text_config.intermediate_size
        only_mlp = set(getattr(text_config, "mlp_only_layers", None) or ())
        step = getattr(text_config, "decoder_sparse_step", 1) or 1
        return sum(
            sparse if i not in only_mlp and text_config.num_experts > 0 and (i + 1) % step == 0 else dense
            for i in range(text_config.num_hidden_layers)
        )

    def decoder_values_per_token(self, text_config: PretrainedConfig) -> float:
        """As the dense layer, with the MLP's 5 values per token for each of the top-k experts' intermediate
        size, plus the router's logits and probabilities (2 E-sized)."""
        hidden = text_config.hidden_size
        head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
        kv = text_config.num_key_value_heads * head_dim
        expert = text_config.num_experts_per_tok * text_config.moe_intermediate_size
        return 8 + 3 * kv / hidden + 5 * expert / hidden + 2 * text_config.num_experts / hidden


class Qwen3VLMoeTestKit(Qwen3VLTestKit):
    """Qwen3-VL's tiny configs and batches with a MoE decoder."""

    config_class = Qwen3VLMoeConfig

    def tiny_text_config(self) -> dict[str, Any]:
        """Qwen3-VL's tiny decoder with every layer sparse: 8 experts, top-2, expert size 48."""
        return {
            **super().tiny_text_config(),
            "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        }


@register_model("qwen3_vl_moe")
class Qwen3VLMoeEntry(QwenMoeEntryMixin, Qwen3VLEntry):
    """Qwen3-VL vision tower (with DeepStack mergers) + Qwen3 MoE decoder with M-RoPE."""

    config_class = Qwen3VLMoeConfig
    model_class = Qwen3VLMoeForConditionalGenerationFSDP
    costs = Qwen3VLMoeCosts()
    testkit = Qwen3VLMoeTestKit()
