"""Devices, process layout and sharding for mmfsdp — nothing model-specific.

The trainer uses this package in this order:
1. `ParallelConfig` (YAML `parallel:`) → `MeshPlan.from_config(cfg, world_size)`
   validates the layout before any process group exists.
2. `detect_device_type()` → `init_process_group(device_type)` →
   `build_parallel_dims(plan, device_type)`: the 4-D mesh
   `(dp_replicate, dp_shard, ring, ulysses)` with its flattened views
   (`cp`, `dp_shard_cp`, `dp`, `dp_cp`), ranks and groups.
3. The model entry declares which modules to shard and checkpoint; this package
   applies that: `apply_activation_checkpointing(model, patterns)` and then
   `apply_fsdp(model, plan, parallel_dims.fsdp_mesh, default_modules)` (or
   `apply_fsdp_groups` with one `FSDPGroup(patterns, mesh)` per mesh), both
   selecting modules with the `{*}` / `{a-b}` patterns of `match_module_names`.
   `apply_activation_offload(model, patterns)` (after checkpointing, before
   FSDP) keeps the saved activations of the matched modules in host memory.
   MoE families first shard their experts over the `ep` mesh with
   `apply_expert_parallel` (token dispatch by all-to-all, `experts_forward`).
4. In the loop, `clip_grad_norm` on the sharded (DTensor) gradients, and
   `SwapAdamW` (`training.optimizer: adamw_swap`) keeps AdamW's moments on the host.

Context parallel lives in `mmfsdp.parallel.cp` and uses the `cp`, `ring` and
`ulysses` groups of `ParallelDims`.
"""

from mmfsdp.parallel.checkpointing import apply_activation_checkpointing, is_checkpointed
from mmfsdp.parallel.config import EPPlanConfig, FSDPPlanConfig, ParallelConfig, RecomputePlanConfig
from mmfsdp.parallel.device import (
    backend_for,
    detect_device_type,
    device_count,
    device_for_local_rank,
    init_process_group,
    peak_memory_gb,
    reset_peak_memory,
    synchronize,
    use_deterministic,
)
from mmfsdp.parallel.expert_parallel import apply_expert_parallel, experts_forward, shard_experts
from mmfsdp.parallel.fsdp import FSDPGroup, apply_fsdp, apply_fsdp_groups
from mmfsdp.parallel.grad import clip_grad_norm
from mmfsdp.parallel.mesh import MESH_AXES, MeshPlan, ParallelDims, build_parallel_dims
from mmfsdp.parallel.offload import ActivationOffload, apply_activation_offload, is_offloaded
from mmfsdp.parallel.patterns import ModulePattern, compile_module_pattern, match_module_names
from mmfsdp.parallel.swap_optimizer import SwapAdamW

__all__ = [
    "ParallelConfig",
    "FSDPPlanConfig",
    "RecomputePlanConfig",
    "EPPlanConfig",
    "apply_expert_parallel",
    "experts_forward",
    "shard_experts",
    "detect_device_type",
    "backend_for",
    "init_process_group",
    "device_for_local_rank",
    "device_count",
    "reset_peak_memory",
    "peak_memory_gb",
    "synchronize",
    "use_deterministic",
    "MESH_AXES",
    "MeshPlan",
    "ParallelDims",
    "build_parallel_dims",
    "ModulePattern",
    "compile_module_pattern",
    "match_module_names",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "apply_fsdp",
    "apply_fsdp_groups",
    "FSDPGroup",
    "clip_grad_norm",
    "ActivationOffload",
    "apply_activation_offload",
    "is_offloaded",
    "SwapAdamW",
]
