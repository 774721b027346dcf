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
  The entry names the routed experts (`expert_modules`) and the routers (`router_modules`) through Qwen3-VL MoE's
  `QwenMoeEntryMixin` (`mmfsdp.model.families.qwen3_vl_moe.model`); the shared expert and its gate are ordinary
  weights of the decoder layer: replicated over expert parallel and sharded by FSDP2 with the layer, as the
  attention is.
- Router statistics as Qwen3-VL MoE's (`QwenMoeModelMixin`, `QwenMoeEntryMixin`): the training forward (with
  `loss_weights`) returns `outputs.router_load` (`mmfsdp.model.router`), the spec's `step_terms`
  (`RouterStepTerms`) adds `features.loss_cfg.router_aux_loss_coef × aux` to each micro-batch's loss and reports
  the aux loss and expert load of the step.
- Checkpoints: `adapter.Qwen3_5MoeAdapter` reads the hub's per-expert layout and transformers 5's fused one.

Shape legend: B batch, S tokens, H hidden size, E experts, I expert intermediate size.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from mmfsdp.model.families.qwen3_5.model import Qwen3_5Costs, Qwen3_5Entry, Qwen3_5TestKit, Qwen3_5TrainingMixin
from mmfsdp.model.families.qwen3_vl_moe.model import QwenMoeEntryMixin, QwenMoeModelMixin, routed_mlp_params
from mmfsdp.model.spec import register_model

__all__ = ["Qwen3_5MoeCosts", "Qwen3_5MoeEntry", "Qwen3_5MoeForConditionalGenerationFSDP", "Qwen3_5MoeTestKit"]


class Qwen3_5MoeForConditionalGenerationFSDP(
    QwenMoeModelMixin, Qwen3_5TrainingMixin, Qwen3_5MoeForConditionalGeneration
):
    """HF `Qwen3_5MoeForConditionalGeneration` plus Qwen3.5's training forward and `outputs.router_load`."""

    sparse_moe_block = Qwen3_5MoeSparseMoeBlock


class Qwen3_5MoeCosts(Qwen3_5Costs):
    """Qwen3.5's costs with a sparse MLP in every layer: the router, the top-k experts, the shared expert and
    its gate."""

    def decoder_mlp_params(self, text_config: PretrainedConfig) -> int:
        """Per layer the router and the top-k experts (`routed_mlp_params`), the shared expert (gate, up, down) and
        the shared expert's gate (`H`)."""
        hidden = text_config.hidden_size
        shared = 3 * hidden * text_config.shared_expert_intermediate_size + hidden
        return text_config.num_hidden_layers * (routed_mlp_params(text_config) + shared)

    def mlp_values_per_token(self, text_config: PretrainedConfig) -> float:
        """The MLP's 5 values per token for each of the top-k experts' and the shared expert's intermediate size,
        plus the router's logits and probabilities (2 E-sized)."""
        intermediate = text_config.num_experts_per_tok * text_config.moe_intermediate_size
        intermediate += text_config.shared_expert_intermediate_size
        return (5 * intermediate + 2 * text_config.num_experts) / text_config.hidden_size


class Qwen3_5MoeTestKit(Qwen3_5TestKit):
    """Qwen3.5's tiny configs and batches with a MoE decoder."""

    config_class = Qwen3_5MoeConfig

    def tiny_text_config(self) -> dict[str, Any]:
        """Qwen3.5's tiny decoder with MoE layers (~0.35M parameters): 8 experts, top-2, expert size 32, a shared
        expert of 48."""
        return {
            **super().tiny_text_config(),
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.01,
        }


@register_model("qwen3_5_moe")
class Qwen3_5MoeEntry(QwenMoeEntryMixin, Qwen3_5Entry):
    """Qwen3.5's vision tower + hybrid decoder with sparse MLPs (routed experts and a gated shared expert)."""

    config_class, model_class = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGenerationFSDP
    costs, testkit = Qwen3_5MoeCosts(), Qwen3_5MoeTestKit()
