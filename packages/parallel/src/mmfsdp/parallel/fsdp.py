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
   offload policy, `reshard_after_forward` and the ignored parameters, except
   that two groups keep their gathered parameters from forward to backward
   whatever `reshard_after_forward` says, because backward needs them first:
   the root (FSDP2's own choice when it is not told, but an explicit `True`
   would free and re-gather it: one more all-gather per step, for a whole tiny
   model grouped into the root that was half its all-gathers) and the last
   group in model order (its backward starts right after the loss, so FSDP2
   would gather it again at once; torchtitan keeps it too). Their memory is one
   group's parameters, held across the short span from the end of forward to
   their backward; the values are the same.
   FSDP2 keeps each forward all-gather's flat buffer until the next group's
   copy-out, so that the two overlap on their streams. Two cases free it as
   soon as the group's parameters are copied out of it instead
   (`_free_all_gather_buffer`, a pre-forward hook after FSDP2's own): the last
   group, whose "next" is the end of the root's forward — after the loss,
   which the model computes inside its forward, so the buffer (a
   vocabulary-sized `lm_head`'s) sat beside the logits with nothing left to
   overlap; and every group on a CPU mesh, where there are no streams to
   overlap (gloo runs each collective to its end), so holding a buffer only
   adds its bytes to the next group's all-gather. The values are the same.
   Small modules are grouped first (`group_small_modules`, `fsdp_plan.min_group_params`): consecutive
   entries of a module list share one group, and a small module outside a list joins the root's group.
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

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from mmfsdp.config import ConfigError, get_logger, warn_once
from mmfsdp.parallel.config import FSDPPlanConfig
from mmfsdp.parallel.direct_comm import install_direct_comm
from mmfsdp.parallel.dtensor_detach import dtensor_detach_without_propagation
from mmfsdp.parallel.dtypes import DTYPES
from mmfsdp.parallel.patterns import match_module_names

__all__ = ["apply_fsdp", "apply_fsdp_groups", "fsdp_gathered", "group_small_modules", "FSDPGroup"]

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
    num_params = {name: sum(p.numel() for p in model.get_submodule(name).parameters()) for name, _ in matched}
    sharded = group_small_modules(matched, num_params, plan.min_group_params, root_mesh)
    last = sharded[-1][0] if sharded else None
    direct = 0
    with dtensor_detach_without_propagation():  # FSDP2 wraps every parameter: no sharding propagation for that
        for names, mesh in sorted(sharded, key=lambda item: item[0][0].count("."), reverse=True):
            modules = [model.get_submodule(name) for name in names]
            kept = {"reshard_after_forward": False} if names is last else {}
            fully_shard(modules[0] if len(modules) == 1 else modules, **{**options(mesh), **kept})
            if names is last or mesh.device_type == "cpu":
                for module in modules:  # after FSDP2's own pre-forward hook (prepended): the copy-out is done
                    module.register_forward_pre_hook(_free_all_gather_buffer)
            # a list of modules shares one FSDP2 state: its first module sets the group's collectives
            direct += plan.direct_cpu_comm and install_direct_comm(modules[0], mesh.get_group(mesh.ndim - 1))
        fully_shard(model, **{**options(root_mesh), "reshard_after_forward": False})
    if root_mesh.device_type == "cpu":
        model.register_forward_pre_hook(_free_all_gather_buffer)
    direct += plan.direct_cpu_comm and install_direct_comm(model, root_mesh.get_group(root_mesh.ndim - 1))
    firsts = [model.get_submodule(names[0]) for names, _ in sharded]  # a group's prefetch handle: its first module
    _set_prefetch(firsts, plan.num_to_forward_prefetch, plan.num_to_backward_prefetch)
    get_logger(__name__).info(
        "FSDP2: %d modules in %d groups + root on mesh %s, param_dtype=%s reduce_dtype=%s%s",
        len(matched), len(sharded), tuple(root_mesh.shape), plan.param_dtype, plan.reduce_dtype,
        f", direct gloo exchanges on {direct} groups" if direct else "",
    )
    return model


@contextlib.contextmanager
def fsdp_gathered(model: nn.Module) -> Iterator[None]:
    """Inside, every FSDP2 group of `model` that a forward gathers stays gathered until the span ends: many forwards
    in a row (the hf rollout engine's one per generated token) all-gather each group once, not once per forward.

    Each FSDP module is told not to reshard after forward (`set_reshard_after_forward(False, recurse=False)`); on
    leaving, every module is resharded (`reshard()`: its unsharded parameters freed) and its groups' previous
    post-forward setting restored, so training steps after the span gather as planned (the root and the last
    group kept, the others resharded per `reshard_after_forward`). The values are FSDP2's all-gathers either way;
    the memory inside is the whole unsharded model, as TRL's `ds3_gather_for_generation` and verl's hf rollout
    hold it. A model without FSDP2 modules, or a torch whose FSDP2 keeps these settings elsewhere, runs as is."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        saved = [(state, state._auto_reshard_after_forward,
                  [(group, group.post_forward_mesh_info) for group in state._fsdp_param_groups])
                 for state in (m._get_fsdp_state() for m in modules)]
    except AttributeError:  # another torch's FSDP2 internals: gather per forward, as without the span
        saved, modules = [], []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info


def _free_all_gather_buffer(module: nn.Module, args) -> None:
    """Free the all-gather buffer FSDP2 keeps after `module`'s copy-out (its `all_gather_state`), as FSDP2 itself
    does at the end of the root's forward: the streams that use it wait for the copy-out first."""
    state = module._get_fsdp_state()
    comm = getattr(state, "_comm_ctx", None)
    kept = getattr(comm, "all_gather_state", None)
    if kept is None:
        return
    if kept.event is not None:
        comm.all_gather_copy_in_stream.wait_event(kept.event)
        comm.all_gather_stream.wait_event(kept.event)
    comm.all_gather_state = None


def _list_parent(name: str) -> str | None:
    """`a.b` for an entry `a.b.3` of a module list; None for a module that is not a list entry."""
    parent, _, last = name.rpartition(".")
    return parent if last.isdigit() else None


def group_small_modules(
    matched: list[tuple[str, DeviceMesh]], num_params: dict[str, int], min_params: int, root_mesh: DeviceMesh
) -> list[tuple[list[str], DeviceMesh]]:
    """The FSDP2 groups of the `matched` modules (in model order) under `fsdp_plan.min_group_params`.

    Consecutive entries of one module list on the same mesh join one group until it holds `min_params`
    parameters (every entry of a list runs in each forward, one after the other, so the group is gathered once
    and freed after its last entry, as FSDP2 does for a list of modules). A module outside a list with fewer
    than `min_params` parameters is left out: the root's group takes its parameters (only on the root's mesh;
    on another mesh it stays a group); so is a whole list (all its matched entries) that holds fewer than
    `min_params` together. `min_params` 0 keeps one group per module. Grouping changes which
    parameters travel in one collective, not the values: FSDP2 shards each parameter on its own, so every
    shard and every reduced gradient is the same.
    """
    if min_params <= 0:
        return [([name], mesh) for name, mesh in matched]
    groups: list[tuple[list[str], DeviceMesh]] = []
    open_parent: str | None = None
    open_size = 0
    for name, mesh in matched:
        parent = _list_parent(name)
        if parent is None:
            open_parent = None
            if num_params[name] >= min_params or mesh is not root_mesh:
                groups.append(([name], mesh))
            continue
        if parent == open_parent and groups[-1][1] is mesh and open_size < min_params:
            groups[-1][0].append(name)
            open_size += num_params[name]
        else:
            groups.append(([name], mesh))
            open_parent, open_size = parent, num_params[name]
    # A list whose matched entries all fit in one group smaller than `min_params` joins the root as well
    # (a tiny model's decoder or tower: one all-gather per step for the whole model instead of one per list).
    per_list: dict[str, list[int]] = {}
    for index, (names, _) in enumerate(groups):
        parent = _list_parent(names[0])
        if parent is not None:
            per_list.setdefault(parent, []).append(index)
    into_root = {
        indices[0] for indices in per_list.values()
        if len(indices) == 1 and groups[indices[0]][1] is root_mesh
        and sum(num_params[name] for name in groups[indices[0]][0]) < min_params
    }
    return [group for index, group in enumerate(groups) if index not in into_root]


def _set_prefetch(modules: list[nn.Module], num_forward: int, num_backward: int) -> None:
    fsdp_modules: list[FSDPModule] = [module for module in modules if isinstance(module, FSDPModule)]
    for i, module in enumerate(fsdp_modules):
        if num_forward > 0 and i + 1 < len(fsdp_modules):
            module.set_modules_to_forward_prefetch(fsdp_modules[i + 1 : i + 1 + num_forward])
        if num_backward > 0 and i > 0:
            module.set_modules_to_backward_prefetch(fsdp_modules[max(0, i - num_backward) : i][::-1])
