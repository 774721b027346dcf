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

import re
from typing import Mapping

import torch

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, ToHF
from mmfsdp.ckpt.errors import CheckpointError

__all__ = ["Qwen3VLMoeAdapter"]

Shape = tuple[int, ...]


_EXPERTS_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\."
    r"(?:(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
"""An expert weight: per-expert `experts.N.{gate,up,down}_proj.weight` or fused `experts.{gate_up,down}_proj`."""


def _transpose(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].transpose(1, 2)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors)


def _stack_gate_up(tensors: list[torch.Tensor]) -> torch.Tensor:
    half = len(tensors) // 2
    return torch.cat([torch.stack(tensors[:half]), torch.stack(tensors[half:])], dim=1)


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

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        plans: dict[str, FromHF] = {}
        fused: dict[str, dict[str, str]] = {}
        per_expert: dict[str, dict[str, dict[int, str]]] = {}
        for key in hf_shapes:
            match = _EXPERTS_RE.match(key)
            if match is None:
                plans[key] = FromHF((key,))
            elif match["fused"]:
                fused.setdefault(match["prefix"], {})[match["fused"]] = key
            else:
                per_expert.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["index"])] = key
        for prefix, keys in fused.items():
            if set(keys) != {"gate_up_proj", "down_proj"}:
                raise CheckpointError(f"{prefix}: the files hold {sorted(keys)} of the fused experts, not both")
            if prefix in per_expert:
                raise CheckpointError(f"{prefix}: the files hold both fused and per-expert expert weights")
            gate_up, down = hf_shapes[keys["gate_up_proj"]], hf_shapes[keys["down_proj"]]
            hub = len(gate_up) == len(down) == 3 and gate_up[2] == 2 * down[1] and gate_up[1] == down[2]
            ours = len(gate_up) == len(down) == 3 and gate_up[1] == 2 * down[2] and gate_up[2] == down[1]
            if not (hub or ours):
                raise CheckpointError(
                    f"{prefix}: gate_up_proj {tuple(gate_up)} and down_proj {tuple(down)} are neither the hub layout "
                    "([E, H, 2I], [E, I, H]) nor transformers 5's ([E, 2I, H], [E, H, I])"
                )
            for name, key in keys.items():
                plans[f"{prefix}.{name}"] = FromHF((key,), _transpose, rowwise=True) if hub else FromHF((key,))
        for prefix, projections in per_expert.items():
            if set(projections) != {"gate_proj", "up_proj", "down_proj"}:
                raise CheckpointError(f"{prefix}: per-expert weights of {sorted(projections)} only")
            experts = sorted(projections["gate_proj"])
            if experts != list(range(len(experts))) or any(sorted(p) != experts for p in projections.values()):
                raise CheckpointError(f"{prefix}: per-expert weights do not cover experts 0..N-1 for every projection")
            gate_up = [projections["gate_proj"][e] for e in experts] + [projections["up_proj"][e] for e in experts]
            plans[f"{prefix}.gate_up_proj"] = FromHF(tuple(gate_up), _stack_gate_up)
            plans[f"{prefix}.down_proj"] = FromHF(tuple(projections["down_proj"][e] for e in experts), _stack)
        return plans

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        return {
            key: ToHF((key,), _split_transposed) if _EXPERTS_RE.match(key) else ToHF((key,))
            for key in model_shapes
        }
