"""Gradient-norm clipping that is correct for FSDP2's DTensor gradients.

After FSDP2's backward each rank holds a shard of every gradient as a `DTensor`.
`clip_grad_norm`:
1. groups the gradients by (mesh, placements) — plain tensors (parameters FSDP
   ignores) form groups of their own — keeping first-seen order, which is the
   same on every rank;
2. takes each group's norm with `torch.nn.utils.get_total_norm`; for a
   sharded group DTensor reduces the shards' partial norms over the group's
   mesh, and `full_tensor()` turns the result into a plain tensor, so every
   rank gets the norm of the whole gradient (the groups are needed because
   DTensors on different meshes cannot be combined in one operation);
3. combines the group norms (the 2-norm of the group 2-norms is the total
   2-norm), and scales each group's gradients by `max_norm / (total + 1e-6)`
   when that is below 1, as `torch.nn.utils.clip_grad_norm_` does.

Parameters sharded on different meshes (e.g. some modules on the FSDP mesh and
others on a 2-D HSDP mesh) therefore work; the norm is over all of them.
Context parallel needs nothing extra: its ranks are part of the FSDP shard
group, whose gradients are already averaged when this runs.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def _group_key(grad: torch.Tensor) -> tuple:
    if isinstance(grad, DTensor):
        return ("dtensor", grad.device_mesh, tuple(grad.placements))
    return ("tensor", grad.device)


def clip_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    foreach: bool | None = None,
    *,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip the gradients of `parameters` to a total norm of `max_norm`; return the total norm before clipping.

    The norm is over all gradients, on every rank (a plain 0-d tensor, equal on all
    ranks for sharded gradients). `max_norm <= 0` only computes the norm.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_group_key(param.grad), []).append(param)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in norms]), norm_type)
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
