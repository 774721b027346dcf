"""The generic parallelisation of a family's model, from the module patterns its spec declares.

`parallelize(entry, model, parallel_cfg, parallel_dims, features_cfg)` is what `ModelEntry.parallelize` does
unless a family overrides it: on the unsharded model (CPU or meta), in place, before the weights are loaded,

1. expert parallel (a spec with `expert_modules`, or EP > 1): the experts modules are sharded over the `ep` mesh
   and run through `mmfsdp.parallel.experts_forward` (also at EP 1); with EP > 1 they form their own FSDP2 group
   on the expert FSDP mesh (`mmfsdp.parallel.expert_parallel`);
2. `torch.compile` per block (`features.compile`; `compile_patterns`);
3. activation checkpointing (`parallel.recompute`);
4. activation offload (`features.activation_offload_plan`);
5. FSDP2 over `fsdp_groups`, with the root on the FSDP mesh.

Each configured pattern list wins over the spec's default; the `(key, patterns)` pairs name which one was used,
for `--check` and for errors. Only the patterns are read (`ModulePatterns`), so this names no family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

from mmfsdp.config import get_logger, warn_once

if TYPE_CHECKING:
    from mmfsdp.model.config import FeaturesConfig
    from mmfsdp.parallel import FSDPGroup, ParallelConfig, ParallelDims

__all__ = ["ModulePatterns", "compile_patterns", "expert_parallel_patterns", "fsdp_groups", "parallelize"]


_log = get_logger(__name__)


class ModulePatterns(Protocol):
    """What parallelising reads of a family's spec (`mmfsdp.model.spec.ModelEntry`)."""

    fsdp_modules: tuple[str, ...]
    recompute_modules: tuple[str, ...]
    expert_modules: tuple[str, ...]

    @property
    def decoder_name(self) -> str: ...


def _configured_or_default(
    entry: ModulePatterns, key: str, configured: list[str] | None, default: tuple[str, ...]
) -> tuple[str, tuple[str, ...]]:
    """(config key, patterns): the configured list when set (less the family's `absent_modules`, with a warning),
    else the family's default (its key says so)."""
    if configured is None:
        return f"{key} (model default)", tuple(default)
    absent = dict(getattr(entry, "absent_modules", ()))
    for pattern in configured:
        if pattern in absent:
            warn_once(f"{key}: {pattern!r} skipped: {absent[pattern]}", _log)
    return key, tuple(p for p in configured if p not in absent)


def expert_parallel_patterns(entry: ModulePatterns, parallel_cfg: ParallelConfig) -> tuple[str, tuple[str, ...]]:
    """(config key, patterns) of the experts modules expert parallel shards: `parallel.ep_plan.apply_modules`,
    or the family's `expert_modules`."""
    return _configured_or_default(entry, "parallel.ep_plan.apply_modules", parallel_cfg.ep_plan.apply_modules,
                                  entry.expert_modules)


def compile_patterns(entry: ModulePatterns, features_cfg: FeaturesConfig) -> tuple[str, list[str]]:
    """(config key, patterns) of the blocks `features.compile` compiles: `features.compile_plan.apply_modules`, or
    the family's recompute patterns under its decoder (`decoder_name`): the decoder layers."""
    prefix = entry.decoder_name + "."
    key, patterns = _configured_or_default(
        entry, "features.compile_plan.apply_modules", features_cfg.compile_plan.apply_modules,
        tuple(p for p in entry.recompute_modules if p.startswith(prefix)),
    )
    return key, list(patterns)


def fsdp_patterns(entry: ModulePatterns, parallel_cfg: ParallelConfig) -> tuple[str, tuple[str, ...]]:
    """(config key, patterns) FSDP2 wraps: `parallel.fsdp_plan.apply_modules`, or the family's `fsdp_modules`."""
    return _configured_or_default(
        entry, "parallel.fsdp_plan.apply_modules", parallel_cfg.fsdp_plan.apply_modules, entry.fsdp_modules
    )


def fsdp_groups(entry: ModulePatterns, parallel_cfg: ParallelConfig, parallel_dims: ParallelDims) -> list[FSDPGroup]:
    """The FSDP2 groups: one, `parallel.fsdp_plan.apply_modules` (or the family's `fsdp_modules`) on the FSDP
    mesh."""
    from mmfsdp.parallel.fsdp import FSDPGroup

    key, patterns = fsdp_patterns(entry, parallel_cfg)
    return [FSDPGroup(patterns, parallel_dims.fsdp_mesh, key)]


def parallelize(
    entry: ModulePatterns,
    model: nn.Module,
    parallel_cfg: ParallelConfig,
    parallel_dims: ParallelDims,
    features_cfg: FeaturesConfig | None = None,
) -> nn.Module:
    """Expert parallel, compile, checkpointing, offload, then FSDP2 (module docstring); `model`, in place."""
    from mmfsdp.parallel import (
        FSDPGroup, apply_activation_checkpointing, apply_activation_offload, apply_expert_parallel, apply_fsdp_groups,
    )

    groups = fsdp_groups(entry, parallel_cfg, parallel_dims)
    if entry.expert_modules or getattr(parallel_dims, "ep_size", 1) > 1:
        key, patterns = expert_parallel_patterns(entry, parallel_cfg)
        ep_mesh = getattr(parallel_dims, "ep_mesh", None)
        names = apply_expert_parallel(model, patterns, ep_mesh, key=key)
        if ep_mesh is not None:
            groups = [FSDPGroup(tuple(names), parallel_dims.expert_fsdp_mesh, key), *groups]
    if features_cfg is not None and features_cfg.compile:
        from mmfsdp.parallel.compile import apply_compile

        key, patterns = compile_patterns(entry, features_cfg)
        plan = features_cfg.compile_plan
        apply_compile(model, patterns, backend=plan.backend, dynamic=plan.dynamic, key=key)
    if parallel_cfg.recompute:
        patterns = parallel_cfg.recompute_plan.apply_modules or entry.recompute_modules
        apply_activation_checkpointing(model, list(patterns))
    offload_modules = [] if features_cfg is None else features_cfg.activation_offload_plan.apply_modules
    if offload_modules:
        apply_activation_offload(model, offload_modules)
    return apply_fsdp_groups(model, parallel_cfg.fsdp_plan, groups, parallel_dims.fsdp_mesh)
