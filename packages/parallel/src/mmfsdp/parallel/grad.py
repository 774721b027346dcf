"""Gradient-norm clipping that is correct for FSDP2's DTensor gradients.

After FSDP2's backward each rank holds a shard of every gradient as a `DTensor`.
`clip_grad_norm`:
1. groups the gradients by (mesh, placements) — plain tensors (parameters FSDP
   ignores) form groups of their own — keeping first-seen order, which is the
   same on every rank;
2. takes each group's sum of `|g|^p` on this rank's shards (`to_local()`, one
   `_foreach_norm`), and all-reduces it over each mesh dimension the group is
   sharded on (`Shard`, or FSDP2's `_StridedShard` over an expert-parallel
   shard; a replicated dimension holds the same values on every rank: not
   summed), so every rank gets the group's `Σ |g|^p` over the whole gradients
   (the max of `|g|` for the inf-norm); a group with pending sums (`Partial`)
   takes DTensor's own reduction;
3. combines the groups (`(Σ_groups Σ |g|^p)^(1/p)`, the total p-norm), and
   scales every rank's shards by `max_norm / (total + 1e-6)` when that is below 1,
   as `torch.nn.utils.clip_grad_norm_` does.

The math is `torch.nn.utils.clip_grad_norm_`'s on the whole gradients; the shards
are handled as plain tensors, not through DTensor's operator dispatch, whose
first call of each operator on a process's meshes costs its sharding
propagation (~0.6 s a rank on a tiny model's first step, every run). Parameters
sharded on different meshes (e.g. some modules on the FSDP mesh, the experts on
their own) therefore work; the norm is over all of them. Context parallel needs
nothing extra: its ranks are part of the FSDP shard group, whose gradients are
already averaged when this runs.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def _group_key(grad: torch.Tensor) -> tuple:
    if isinstance(grad, DTensor):
        return ("dtensor", grad.device_mesh, tuple(grad.placements))
    return ("tensor", grad.device)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _group_power(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Σ |g|^p (the max of |g| for the inf-norm) over the whole gradients `grads` of one group, in fp32."""
    first, inf = grads[0], math.isinf(norm_type)
    if isinstance(first, DTensor) and any(placement.is_partial() for placement in first.placements):
        # pending sums: |g|^p of the parts is not that of their sum; DTensor's own reduction
        norm = torch.nn.utils.get_total_norm(grads, norm_type).full_tensor().float()
        return norm if inf else norm.pow(norm_type)
    norms = torch._foreach_norm([_local(g) for g in grads], norm_type)
    stacked = torch.stack([n.float() for n in norms])
    value = stacked.max() if inf else stacked.pow(norm_type).sum()
    if isinstance(first, DTensor):
        mesh = first.device_mesh
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        for dim, placement in enumerate(first.placements):
            if not placement.is_replicate():  # Shard, and FSDP2's _StridedShard over a sharded dim (not a Shard)
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value


def clip_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    foreach: bool | None = None,
    *,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip the gradients of `parameters` to a total norm of `max_norm`; return the total norm before clipping.

    The norm is over all gradients, on every rank (a plain 0-d fp32 tensor, equal on all ranks for sharded
    gradients). `max_norm <= 0` only computes the norm. `foreach` is accepted for `clip_grad_norm_`'s signature:
    the shards are always scaled with one foreach call.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_group_key(param.grad), []).append(param.grad)
    if not groups:
        return torch.tensor(0.0)
    powers = [_group_power(grads, norm_type) for grads in groups.values()]
    device = powers[0].device
    stacked = torch.stack([p.to(device) for p in powers])
    total = stacked.max() if math.isinf(norm_type) else stacked.sum().pow(1.0 / norm_type)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            local = [_local(g) for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].device))
    return total
