"""Toy state-dict adapters for the mmfsdp.ckpt tests, installed as entry points by the `toy_adapters` fixture.

- `toy_prefix`: file `legacy.*` <-> model `model.*` (a pure rename).
- `toy_moe`: file `<...>.experts.<i>.<leaf>` (one tensor per expert) <-> model `<...>.experts.<leaf>`
  (`[num_experts, ...]`, `torch.stack` / `torch.unbind`), and file `<...>.gate.weight` + `<...>.up.weight`
  <-> model `<...>.gate_up.weight` (concatenated along dim 1, so the exported halves are non-contiguous views).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from mmfsdp.ckpt.adapters import FromHF, RenameAdapter, StateDictAdapter, ToHF

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<leaf>.+)$")
_HALVES = (".gate.weight", ".up.weight")


class ToyPrefixAdapter(RenameAdapter):
    model_id = "toy_prefix"
    hf_model_types = ("toy_prefix",)
    renames = (("legacy.", "model."),)


def _cat_dim1(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=1)


def _halves(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensor.chunk(2, dim=1)


class ToyMoEAdapter(StateDictAdapter):
    model_id = "toy_moe"
    hf_model_types = ("toy_moe",)

    def from_hf(self, hf_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FromHF]:
        plans: dict[str, FromHF] = {}
        experts: dict[str, dict[int, str]] = {}
        for key in hf_shapes:
            match = _EXPERT.match(key)
            if match:
                experts.setdefault(f"{match['prefix']}.{match['leaf']}", {})[int(match["index"])] = key
            elif key.endswith(_HALVES[0]):
                stem = key[: -len(_HALVES[0])]
                plans[stem + ".gate_up.weight"] = FromHF((key, stem + _HALVES[1]), combine=_cat_dim1)
            elif not key.endswith(_HALVES[1]):
                plans[key] = FromHF((key,))
        for name, by_index in experts.items():
            plans[name] = FromHF(tuple(by_index[i] for i in sorted(by_index)), combine=torch.stack)
        return plans

    def to_hf(self, model_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ToHF]:
        plans: dict[str, ToHF] = {}
        for name, shape in model_shapes.items():
            stem, experts, leaf = name.partition(".experts.")
            if experts:
                plans[name] = ToHF(tuple(f"{stem}.experts.{i}.{leaf}" for i in range(shape[0])), split=torch.unbind)
            elif name.endswith(".gate_up.weight"):
                stem = name[: -len(".gate_up.weight")]
                plans[name] = ToHF((stem + _HALVES[0], stem + _HALVES[1]), split=_halves)
            else:
                plans[name] = ToHF((name,))
        return plans
