"""Qwen3.5 MoE (HF `Qwen3_5MoeForConditionalGeneration`, e.g. Qwen3.5-35B-A3B, -397B-A17B) as model id
`qwen3_5_moe`.

The vision tower, M-RoPE and the hybrid decoder's token mixers (Gated DeltaNet and gated attention, as
`text_config.layer_types` says) are Qwen3.5's, so the model class mixes the same `Qwen3_5TrainingMixin` into the HF
class (`mmfsdp.model.families.qwen3_5.model`: the Gated DeltaNet layers routed through the packed, CP-exact
operator, so packing and context parallel, as the dense family). What the MoE adds, in every decoder layer:

- `mlp` is a `Qwen3_5MoeSparseMoeBlock`: a router `gate` (`[E, H]`, softmax, top-k, renormalised, as
  Qwen3-VL MoE's), the routed `experts` as fused tensors `gate_up_proj` `[E, 2·I, H]` (gate rows first) and
  `down_proj` `[E, H, I]` (expert layout `hf_fused`, what expert parallel splits along E), and a shared expert
  (`shared_expert`, a gated MLP of `shared_expert_intermediate_size`) scaled by `sigmoid(shared_expert_gate(x))`.
  The entry names the routed experts (`expert_modules`) and the routers (`router_modules`); the shared expert and
  its gate are ordinary weights of the decoder layer: replicated over expert parallel and sharded by FSDP2 with
  the layer, as the attention is.
- Router statistics as Qwen3-VL MoE's: the training forward (with `loss_weights`) returns `outputs.router_load`
  (`mmfsdp.model.router`), the spec's `step_terms` (`RouterStepTerms`) adds
  `features.loss_cfg.router_aux_loss_coef × aux` to each micro-batch's loss and reports the aux loss and expert
  load of the step.
- Checkpoints: `adapter.Qwen3_5MoeAdapter` reads the hub's per-expert layout and transformers 5's fused one.

Shape legend: B batch, S tokens, H hidden size, E experts, I expert intermediate size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from mmfsdp.model.families.qwen3_5.model import Qwen3_5Costs, Qwen3_5Entry, Qwen3_5TestKit, Qwen3_5TrainingMixin
from mmfsdp.model.router import RouterLoadForward, RouterStepTerms
from mmfsdp.model.spec import Capabilities, register_model

if TYPE_CHECKING:
    from mmfsdp.model.config import LossConfig

__all__ = ["Qwen3_5MoeCosts", "Qwen3_5MoeEntry", "Qwen3_5MoeForConditionalGenerationFSDP", "Qwen3_5MoeTestKit"]


class Qwen3_5MoeForConditionalGenerationFSDP(
    RouterLoadForward, Qwen3_5TrainingMixin, Qwen3_5MoeForConditionalGeneration
):
    """HF `Qwen3_5MoeForConditionalGeneration` plus Qwen3.5's training forward and `outputs.router_load`."""

    def __init__(self, config: Qwen3_5MoeConfig):
        super().__init__(config)
        self.init_training_forward()
        self.init_router_load(Qwen3_5MoeSparseMoeBlock, top_k=config.text_config.num_experts_per_tok)


class Qwen3_5MoeCosts(Qwen3_5Costs):
    """Qwen3.5's costs with a sparse MLP in every layer: the router, the top-k experts, the shared expert and
    its gate."""

    def decoder_mlp_params(self, text_config: PretrainedConfig) -> int:
        """Per layer the router (`H·E`), the top-k experts and the shared expert (gate, up, down each) and the
        shared expert's gate (`H`)."""
        hidden = text_config.hidden_size
        routed = text_config.num_experts_per_tok * 3 * hidden * text_config.moe_intermediate_size
        shared = 3 * hidden * text_config.shared_expert_intermediate_size + hidden
        return text_config.num_hidden_layers * (hidden * text_config.num_experts + routed + shared)

    def mlp_values_per_token(self, text_config: PretrainedConfig) -> float:
        """The MLP's 5 values per token for each of the top-k experts' and the shared expert's intermediate size,
        plus the router's logits and probabilities (2 E-sized)."""
        intermediate = text_config.num_experts_per_tok * text_config.moe_intermediate_size
        intermediate += text_config.shared_expert_intermediate_size
        return (5 * intermediate + 2 * text_config.num_experts) / text_config.hidden_size


class Qwen3_5MoeTestKit(Qwen3_5TestKit):
    """Qwen3.5's tiny configs and batches with a MoE decoder."""

    config_class = Qwen3_5MoeConfig

    def tiny_config(self, *, vocab_size: int = 256, image_token_id: int = 10, **overrides: Any) -> Qwen3_5MoeConfig:
        """`Qwen3_5TestKit.tiny_config` with MoE layers (~0.35M parameters): 8 experts, top-2, expert size 32, a shared
        expert of 48."""
        text = dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
        )
        text.update(overrides.pop("text_config", {}))
        return super().tiny_config(vocab_size=vocab_size, image_token_id=image_token_id, text_config=text, **overrides)


@register_model("qwen3_5_moe")
class Qwen3_5MoeEntry(Qwen3_5Entry):
    """Qwen3.5's vision tower + hybrid decoder with sparse MLPs (routed experts and a gated shared expert)."""

    config_class = Qwen3_5MoeConfig
    model_class = Qwen3_5MoeForConditionalGenerationFSDP
    expert_modules = ("model.language_model.layers.{*}.mlp.experts",)
    """The fused routed experts (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`): what expert parallel
    shards along E."""
    router_modules = ("model.language_model.layers.{*}.mlp.gate",)
    """The routers (`weight` `[E, H]`), replicated over expert parallel."""
    capabilities = Capabilities(context_parallel=True, packing=True, video=True, expert_layout="hf_fused")
    """Packing and context parallel (`mmfsdp.model.families.qwen3_5.model`); video; expert parallel."""
    costs = Qwen3_5MoeCosts()
    testkit = Qwen3_5MoeTestKit()

    def num_experts(self, config: Qwen3_5MoeConfig) -> int:
        return int(config.text_config.num_experts)

    def step_terms(self, loss_cfg: LossConfig) -> RouterStepTerms:
        """The router load-balancing loss (× `router_aux_loss_coef`) and the expert load of each step."""
        return RouterStepTerms(loss_cfg.router_aux_loss_coef)
