"""Apply FSDP2 (`torch.distributed.fsdp.fully_shard`) to a model by module name patterns.

Flow of `apply_fsdp(model, plan, mesh, default_modules)`:
1. Resolve `plan.apply_modules` (or the model entry's `default_modules`) and
   `plan.ignored_modules` to module names with `match_module_names`.
2. `fully_shard` every matched module, deepest first, so each becomes one
   parameter group that is all-gathered just before its forward and
   reduce-scattered right after its backward; then `fully_shard` the root,
   which takes every parameter not already in a group (embeddings, final norm...).

`apply_fsdp_groups(model, plan, groups, root_mesh)` is the same over several
`FSDPGroup(patterns, mesh)` — each group's modules on its own mesh (a model
entry's `parallelize` may, say, shard the vision tower on another mesh than the
decoder) — and the root on `root_mesh`; `apply_fsdp` is its one-group case.
3. Every call gets the same `MixedPrecisionPolicy(param_dtype, reduce_dtype)`,
   offload policy, `reshard_after_forward` and the ignored parameters. (FSDP2
   keeps the root's parameters gathered after forward regardless, since
   backward needs them first.)
4. With `num_to_forward_prefetch` / `num_to_backward_prefetch` > 0, each matched
   module is told to start gathering the next / previous N matched modules
   (model order is taken as execution order).

Activation checkpointing (`apply_activation_checkpointing`) must run before
this, on the unsharded model; it wraps `forward` in place, so the FSDP groups
and the parameter names are the same with or without it.

Gradients: FSDP2 averages gradients over all ranks of `mesh` (for HSDP, over
replicas × shards). With context parallel the shard group is `dp_shard_cp`, so
the ranks of one CP group, which see different tokens of the same samples,
are averaged in too; the trainer's loss normalisation accounts for that.

Ignored modules: their parameters stay whole on every rank and their gradients
are not synchronised, so they should be frozen (a warning says so otherwise).
Frozen parameters elsewhere are sharded like the others and get no gradient.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from mmfsdp.config import ConfigError, get_logger, warn_once
from mmfsdp.parallel.config import FSDPPlanConfig
from mmfsdp.parallel.dtypes import DTYPES
from mmfsdp.parallel.patterns import match_module_names

__all__ = ["apply_fsdp", "apply_fsdp_groups", "FSDPGroup"]

_KEY = "parallel.fsdp_plan"


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def _ignored_params(model: nn.Module, plan: FSDPPlanConfig) -> set[nn.Parameter]:
    if not plan.ignored_modules:
        return set()
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ConfigError(
            f"{_KEY}.ignored_modules",
            f"this torch ({torch.__version__}) has no fully_shard(ignored_params=...); "
            "remove ignored_modules (freeze those modules instead) or upgrade torch",
        )
    names = match_module_names(model, plan.ignored_modules, key=f"{_KEY}.ignored_modules")
    params = {param for name in names for param in model.get_submodule(name).parameters()}
    if any(param.requires_grad for param in params):
        warn_once(
            "parallel.fsdp_plan.ignored_modules holds trainable parameters; FSDP does not synchronise "
            "their gradients across ranks, so the replicas drift apart unless those modules are frozen"
        )
    return params


@dataclass(frozen=True, slots=True)
class FSDPGroup:
    """Module name patterns whose every match becomes one FSDP2 group on `mesh`."""

    patterns: tuple[str, ...]
    mesh: DeviceMesh
    key: str = f"{_KEY}.apply_modules"
    """Config key named when a pattern matches nothing."""


def apply_fsdp(model: nn.Module, plan: FSDPPlanConfig, mesh: DeviceMesh, default_modules: list[str]) -> nn.Module:
    """Shard `model` in place with FSDP2 following `plan` on `mesh` (1-D FSDP or 2-D HSDP); return it."""
    if plan.apply_modules is not None:
        group = FSDPGroup(tuple(plan.apply_modules), mesh)
    else:
        group = FSDPGroup(tuple(default_modules), mesh, f"{_KEY}.apply_modules (model default)")
    return apply_fsdp_groups(model, plan, [group], mesh)


def apply_fsdp_groups(model: nn.Module, plan: FSDPPlanConfig, groups: list[FSDPGroup], root_mesh: DeviceMesh) -> nn.Module:
    """Shard every module matched by each group on its mesh, deepest first, then the root on `root_mesh`.

    `plan` gives the options of every call (mixed precision, offload, resharding,
    ignored modules, prefetch); `plan.apply_modules` is not read here — the
    caller has already chosen the groups.
    """
    matched: list[tuple[str, DeviceMesh]] = []
    seen: set[str] = set()
    for group in groups:  # a module two groups match is sharded once, on the first group's mesh (experts first)
        for name in match_module_names(model, list(group.patterns), key=group.key):
            if name not in seen:
                seen.add(name)
                matched.append((name, group.mesh))
    ignored = _ignored_params(model, plan)

    def options(mesh: DeviceMesh) -> dict:
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=plan.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=_dtype(plan.param_dtype), reduce_dtype=_dtype(plan.reduce_dtype)),
            # pinned host memory needs an accelerator; on a CPU mesh offloading only keeps the same placement
            offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if plan.cpu_offload else OffloadPolicy(),
        )
        if ignored:
            kwargs["ignored_params"] = ignored
        return kwargs

    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    matched.sort(key=lambda item: order[item[0]])
    for name, mesh in sorted(matched, key=lambda item: item[0].count("."), reverse=True):
        fully_shard(model.get_submodule(name), **options(mesh))
    fully_shard(model, **options(root_mesh))
    _set_prefetch([model.get_submodule(name) for name, _ in matched], plan.num_to_forward_prefetch, plan.num_to_backward_prefetch)
    get_logger(__name__).info(
        "FSDP2: %d modules + root on mesh %s, param_dtype=%s reduce_dtype=%s",
        len(matched), tuple(root_mesh.shape), plan.param_dtype, plan.reduce_dtype,
    )
    return model


def _set_prefetch(modules: list[nn.Module], num_forward: int, num_backward: int) -> None:
    fsdp_modules: list[FSDPModule] = [module for module in modules if isinstance(module, FSDPModule)]
    for i, module in enumerate(fsdp_modules):
        if num_forward > 0 and i + 1 < len(fsdp_modules):
            module.set_modules_to_forward_prefetch(fsdp_modules[i + 1 : i + 1 + num_forward])
        if num_backward > 0 and i > 0:
            module.set_modules_to_backward_prefetch(fsdp_modules[max(0, i - num_backward) : i][::-1])
