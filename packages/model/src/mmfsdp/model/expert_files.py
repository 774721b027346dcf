"""Fused MoE experts in HF files: the per-expert layout and the fused one, told apart by key.

A MoE family whose model keeps its routed experts fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, gate rows then
up rows, and `mlp.experts.down_proj` `[E, H, I]`, transformers 5's layout) meets files that hold them either
fused, under the same keys (whatever the tensors' layout: the family's adapter decides), or per expert, as
`nn.Linear` weights `mlp.experts.N.{gate,up}_proj.weight` `[I, H]` and `mlp.experts.N.down_proj.weight` `[H, I]`
(the hub's layout of several families, and what transformers 5 converts on load):

    gate_up_proj = cat(stack(gate_0..gate_{E-1}), stack(up_0..up_{E-1}), dim 1),   down_proj = stack(down_e)

`sort_expert_keys` splits a file's keys into the other keys, the fused pairs and the per-expert sets (checking
that each is whole); `stack_per_expert` plans the model tensors of the per-expert sets, `unstack_per_expert` the
inverse, for a family that writes the per-expert layout back. Both are plain tensor operations, as
`mmfsdp.ckpt.adapters` needs them (they also run on meta tensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from mmfsdp.ckpt.adapters import FromHF, ToHF
from mmfsdp.ckpt.errors import CheckpointError

__all__ = ["EXPERT_KEY", "ExpertKeys", "sort_expert_keys", "stack_per_expert", "unstack_per_expert"]

EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\."
    r"(?:(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
"""An expert weight: per-expert `experts.N.{gate,up,down}_proj.weight` or fused `experts.{gate_up,down}_proj`."""


@dataclass(slots=True)
class ExpertKeys:
    """A file's keys, sorted by `sort_expert_keys`."""

    others: list[str] = field(default_factory=list)
    """Keys that are no expert weight, in file order."""
    fused: dict[str, dict[str, str]] = field(default_factory=dict)
    """Experts prefix (`...mlp.experts`) -> {`gate_up_proj` / `down_proj`: file key}, both present."""
    per_expert: dict[str, dict[str, dict[int, str]]] = field(default_factory=dict)
    """Experts prefix -> projection (`gate_proj`, `up_proj`, `down_proj`) -> expert index -> file key."""


def sort_expert_keys(hf_keys: Iterable[str]) -> ExpertKeys:
    """Sort `hf_keys`; a fused pair missing one tensor, or one prefix in both layouts, is a `CheckpointError`."""
    keys = ExpertKeys()
    for key in hf_keys:
        match = EXPERT_KEY.match(key)
        if match is None:
            keys.others.append(key)
        elif match["fused"]:
            keys.fused.setdefault(match["prefix"], {})[match["fused"]] = key
        else:
            projections = keys.per_expert.setdefault(match["prefix"], {})
            projections.setdefault(match["proj"], {})[int(match["index"])] = key
    for prefix, names in keys.fused.items():
        if set(names) != {"gate_up_proj", "down_proj"}:
            raise CheckpointError(f"{prefix}: the files hold {sorted(names)} of the fused experts, not both")
        if prefix in keys.per_expert:
            raise CheckpointError(f"{prefix}: the files hold both fused and per-expert expert weights")
    return keys


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


def stack_per_expert(per_expert: dict[str, dict[str, dict[int, str]]]) -> dict[str, FromHF]:
    """Model key (`{prefix}.gate_up_proj`, `{prefix}.down_proj`) -> its plan from the per-expert file keys; every
    projection must cover experts 0..E-1."""
    plans: dict[str, FromHF] = {}
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


def unstack_per_expert(key: str, num_experts: int) -> ToHF:
    """The per-expert file keys of the fused model tensor `key` (`...mlp.experts.{gate_up,down}_proj`)."""
    match = EXPERT_KEY.match(key)
    assert match is not None and match["fused"], key
    prefix, experts = match["prefix"], range(num_experts)
    if match["fused"] == "down_proj":
        return ToHF(tuple(f"{prefix}.{e}.down_proj.weight" for e in experts), _unstack)
    names = [f"{prefix}.{e}.{proj}.weight" for proj in ("gate_proj", "up_proj") for e in experts]
    return ToHF(tuple(names), _unstack_gate_up)
