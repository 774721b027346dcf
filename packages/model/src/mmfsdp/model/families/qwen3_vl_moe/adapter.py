"""Qwen3-VL MoE's state-dict adapter: HF safetensors file names <-> `state_dict()` names.

Declared under model id `qwen3_vl_moe` in the `mmfsdp.state_dict_adapters` entry-point group of this package,
so `mmfsdp.ckpt` finds it by `--model_id` or by `config.json`'s `model_type`. The names are Qwen3-VL's, but the
expert weights come in three layouts (`Qwen3VLMoeAdapter`):

| file                                                   | `state_dict()`                          |
| ------------------------------------------------------ | --------------------------------------- |
| hub: `experts.gate_up_proj` `[E, H, 2I]`               | `experts.gate_up_proj` `[E, 2I, H]` (transposed) |
| hub: `experts.down_proj` `[E, I, H]`                   | `experts.down_proj` `[E, H, I]` (transposed) |
| transformers 5 `save_pretrained`: `[E, 2I, H]`, `[E, H, I]` | the same                          |
| `experts.N.{gate,up}_proj.weight` `[I, H]`             | `gate_up_proj` = cat(stack(gate), stack(up), dim 1) |
| `experts.N.down_proj.weight` `[H, I]`                  | `down_proj` = stack(down)               |
"""

from __future__ import annotations

from typing import Mapping

import torch

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, ToHF
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.model.expert_files import EXPERT_KEY, sort_expert_keys, stack_per_expert

__all__ = ["Qwen3VLMoeAdapter"]

Shape = tuple[int, ...]


def _transpose(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].transpose(1, 2)


def _split_transposed(tensor: torch.Tensor) -> tuple[torch.Tensor]:
    return (tensor.transpose(1, 2),)


class Qwen3VLMoeAdapter(StateDictAdapter):
    """Qwen3-VL MoE: Qwen3-VL's names; expert tensors in three layouts on load, the hub's on export.

    `state_dict()` (transformers 5): `experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up), `experts.down_proj`
    `[E, H, I]`. Files may hold (a) the hub's fused layout `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]`
    (Qwen/Qwen3-VL-30B-A3B-*, transformers 4.57), transposed on load; (b) transformers 5 `save_pretrained`'s, the
    `state_dict()` layout, taken as it is; (c) older per-expert exports `experts.N.{gate,up,down}_proj.weight`
    (`nn.Linear` `[I, H]`, `[I, H]`, `[H, I]`), stacked. The fused layouts are told apart by the pair of one layer:
    (a) has `gate_up.shape[2] == 2 · down.shape[1]`, (b) `gate_up.shape[1] == 2 · down.shape[2]`; never both.
    `to_hf` writes (a), which transformers 4.57 and 5 and the inference engines read; `mm-convert dcp_to_hf`
    writes the `state_dict()` layout instead when that is what `--model_assets_dir`'s weights hold.
    """

    model_id = "qwen3_vl_moe"
    hf_model_types = ("qwen3_vl_moe",)
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    export_config_defaults = (("text_config.norm_topk_prob", True),)  # HF's router always renormalises its top k

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        keys = sort_expert_keys(hf_shapes)
        plans = {key: FromHF((key,)) for key in keys.others}
        for prefix, names in keys.fused.items():
            gate_up, down = hf_shapes[names["gate_up_proj"]], hf_shapes[names["down_proj"]]
            hub = len(gate_up) == len(down) == 3 and gate_up[2] == 2 * down[1] and gate_up[1] == down[2]
            ours = len(gate_up) == len(down) == 3 and gate_up[1] == 2 * down[2] and gate_up[2] == down[1]
            if not (hub or ours):
                raise CheckpointError(
                    f"{prefix}: gate_up_proj {tuple(gate_up)} and down_proj {tuple(down)} are neither the hub layout "
                    "([E, H, 2I], [E, I, H]) nor transformers 5's ([E, 2I, H], [E, H, I])"
                )
            for name, key in names.items():
                plans[f"{prefix}.{name}"] = FromHF((key,), _transpose, rowwise=True) if hub else FromHF((key,))
        plans.update(stack_per_expert(keys.per_expert))
        return plans

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        return {
            key: ToHF((key,), _split_transposed) if EXPERT_KEY.match(key) else ToHF((key,))
            for key in model_shapes
        }
