"""Qwen3.5 MoE's state-dict adapter: HF safetensors file names <-> `state_dict()` names.

Declared under model id `qwen3_5_moe` in the `mmfsdp.state_dict_adapters` entry-point group of this package.
The names are Qwen3.5's (`model.language_model.*`, `model.visual.*`, `lm_head.*`); the routed experts come in
two layouts:

| file                                                       | `state_dict()`                                 |
| ---------------------------------------------------------- | ---------------------------------------------- |
| hub: `experts.N.{gate,up}_proj.weight` `[I, H]`             | `experts.gate_up_proj` `[E, 2I, H]` (stacked) |
| hub: `experts.N.down_proj.weight` `[H, I]`                  | `experts.down_proj` `[E, H, I]` (stacked)     |
| transformers 5 `save_pretrained`: `[E, 2I, H]`, `[E, H, I]` | the same                                       |

Each expert's `[2I, H]` of `gate_up_proj` is its gate rows, then its up rows: cat(stack(gate), stack(up), dim 1).
The hub's per-expert layout is what transformers 5 itself converts on load (its conversion mapping of
`qwen3_5_moe_text` merges `mlp.experts.*.{gate,up,down}_proj.weight`); `to_hf` writes it back, so inference
engines that read the released checkpoints read ours. The shared expert (`mlp.shared_expert.*`), its gate
(`mlp.shared_expert_gate`) and the router (`mlp.gate`) keep their names. The hub's multi-token-prediction tensors
(`mtp.*`) have no place in the HF model class: they are not read (`skipped_hf_prefixes`).
"""

from __future__ import annotations

from typing import Mapping

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, ToHF
from mmfsdp.model.expert_files import EXPERT_KEY, sort_expert_keys, stack_per_expert, unstack_per_expert

__all__ = ["Qwen3_5MoeAdapter"]

Shape = tuple[int, ...]


class Qwen3_5MoeAdapter(StateDictAdapter):
    """Qwen3.5 MoE: Qwen3.5's names; routed experts per expert (the hub's) or fused (`state_dict()`'s) on load,
    per expert on export (module docstring)."""

    model_id = "qwen3_5_moe"
    hf_model_types = ("qwen3_5_moe",)
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    skipped_hf_prefixes = (("mtp.", "the multi-token-prediction head; HF's Qwen3.5 model class has no such module"),)

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        keys = sort_expert_keys(hf_shapes)
        plans = {key: FromHF((key,)) for key in keys.others}
        plans.update({key: FromHF((key,)) for names in keys.fused.values() for key in names.values()})
        plans.update(stack_per_expert(keys.per_expert))
        return plans

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        plans: dict[str, ToHF] = {}
        for key, shape in model_shapes.items():
            match = EXPERT_KEY.match(key)
            plans[key] = unstack_per_expert(key, shape[0]) if match and match["fused"] else ToHF((key,))
        return plans
