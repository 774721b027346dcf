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

import re
from typing import Mapping

import torch

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, ToHF
from mmfsdp.ckpt.errors import CheckpointError

__all__ = ["Qwen3_5MoeAdapter"]

Shape = tuple[int, ...]

_EXPERTS_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\."
    r"(?:(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
"""A routed expert weight: per-expert `experts.N.{gate,up,down}_proj.weight` or fused `experts.{gate_up,down}_proj`."""


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors)


def _stack_gate_up(tensors: list[torch.Tensor]) -> torch.Tensor:
    half = len(tensors) // 2
    return torch.cat([torch.stack(tensors[:half]), torch.stack(tensors[half:])], dim=1)


def _unstack(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.unbind(0))


def _unstack_gate_up(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gate, up = tensor.chunk(2, dim=1)
    return (*gate.unbind(0), *up.unbind(0))


class Qwen3_5MoeAdapter(StateDictAdapter):
    """Qwen3.5 MoE: Qwen3.5's names; routed experts per expert (the hub's) or fused (`state_dict()`'s) on load,
    per expert on export (module docstring)."""

    model_id = "qwen3_5_moe"
    hf_model_types = ("qwen3_5_moe",)
    skipped_hf_prefixes = (("mtp.", "the multi-token-prediction head; HF's Qwen3.5 model class has no such module"),)

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        plans: dict[str, FromHF] = {}
        fused: dict[str, set[str]] = {}
        per_expert: dict[str, dict[str, dict[int, str]]] = {}
        for key in hf_shapes:
            match = _EXPERTS_RE.match(key)
            if match is None:
                plans[key] = FromHF((key,))
            elif match["fused"]:
                fused.setdefault(match["prefix"], set()).add(match["fused"])
                plans[key] = FromHF((key,))
            else:
                per_expert.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["index"])] = key
        for prefix, names in fused.items():
            if names != {"gate_up_proj", "down_proj"}:
                raise CheckpointError(f"{prefix}: the files hold {sorted(names)} of the fused experts, not both")
            if prefix in per_expert:
                raise CheckpointError(f"{prefix}: the files hold both fused and per-expert expert weights")
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
        plans: dict[str, ToHF] = {}
        for key, shape in model_shapes.items():
            match = _EXPERTS_RE.match(key)
            if match is None or not match["fused"]:
                plans[key] = ToHF((key,))
                continue
            prefix, experts = match["prefix"], range(shape[0])
            if match["fused"] == "down_proj":
                plans[key] = ToHF(tuple(f"{prefix}.{e}.down_proj.weight" for e in experts), _unstack)
            else:
                names = [f"{prefix}.{e}.{proj}.weight" for proj in ("gate_proj", "up_proj") for e in experts]
                plans[key] = ToHF(tuple(names), _unstack_gate_up)
        return plans
