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
   FSDP) keeps the saved activations of the matched modules in host memory; `apply_compile(model, patterns)`
   (first of all) compiles each matched block's forward with `torch.compile`.
   MoE families first shard their experts over the `ep` mesh with
   `apply_expert_parallel` (token dispatch by all-to-all, `experts_forward`).
4. In the loop, `clip_grad_norm` on the sharded (DTensor) gradients, `ShardAdamW` (AdamW updating each
   DTensor's local shard with torch's fused kernel), and `SwapAdamW` (`training.optimizer: adamw_swap`), the same
   with AdamW's moments on the host.

Context parallel lives in `mmfsdp.parallel.cp` and uses the `cp`, `ring` and
`ulysses` groups of `ParallelDims`.
"""

from mmfsdp.config.lazy import lazy_exports

# Names load on first use (PEP 562): reading a config (`ParallelConfig`, `MeshPlan`) must not import FSDP2 and
# DTensor (with sympy, about 3 s of CPU), which a launcher that starts no process group never uses.
_LAZY = {
    "apply_activation_checkpointing": "mmfsdp.parallel.checkpointing",
    "is_checkpointed": "mmfsdp.parallel.checkpointing",
    "apply_compile": "mmfsdp.parallel.compile",
    "is_compiled": "mmfsdp.parallel.compile",
    "EPPlanConfig": "mmfsdp.parallel.config",
    "FSDPPlanConfig": "mmfsdp.parallel.config",
    "ParallelConfig": "mmfsdp.parallel.config",
    "RecomputePlanConfig": "mmfsdp.parallel.config",
    "backend_for": "mmfsdp.parallel.device",
    "detect_device_type": "mmfsdp.parallel.device",
    "device_count": "mmfsdp.parallel.device",
    "device_for_local_rank": "mmfsdp.parallel.device",
    "init_process_group": "mmfsdp.parallel.device",
    "peak_memory_gb": "mmfsdp.parallel.device",
    "reset_peak_memory": "mmfsdp.parallel.device",
    "synchronize": "mmfsdp.parallel.device",
    "use_deterministic": "mmfsdp.parallel.device",
    "freeze_startup_heap": "mmfsdp.parallel.device",
    "enable_fault_stacks": "mmfsdp.parallel.device",
    "DTYPES": "mmfsdp.parallel.dtypes",
    "dtype_name": "mmfsdp.parallel.dtypes",
    "apply_expert_parallel": "mmfsdp.parallel.expert_parallel",
    "experts_forward": "mmfsdp.parallel.expert_parallel",
    "shard_experts": "mmfsdp.parallel.expert_parallel",
    "FSDPGroup": "mmfsdp.parallel.fsdp",
    "apply_fsdp": "mmfsdp.parallel.fsdp",
    "apply_fsdp_groups": "mmfsdp.parallel.fsdp",
    "fsdp_gathered": "mmfsdp.parallel.fsdp",
    "group_small_modules": "mmfsdp.parallel.fsdp",
    "clip_grad_norm": "mmfsdp.parallel.grad",
    "MESH_AXES": "mmfsdp.parallel.mesh",
    "MeshPlan": "mmfsdp.parallel.mesh",
    "ParallelDims": "mmfsdp.parallel.mesh",
    "build_parallel_dims": "mmfsdp.parallel.mesh",
    "ActivationOffload": "mmfsdp.parallel.offload",
    "apply_activation_offload": "mmfsdp.parallel.offload",
    "is_offloaded": "mmfsdp.parallel.offload",
    "ModulePattern": "mmfsdp.parallel.patterns",
    "compile_module_pattern": "mmfsdp.parallel.patterns",
    "match_module_names": "mmfsdp.parallel.patterns",
    "ShardAdamW": "mmfsdp.parallel.shard_adamw",
    "SwapAdamW": "mmfsdp.parallel.swap_optimizer",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    "freeze_startup_heap",
    "enable_fault_stacks",
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
    "DTYPES",
    "dtype_name",
    "MESH_AXES",
    "MeshPlan",
    "ParallelDims",
    "build_parallel_dims",
    "ModulePattern",
    "compile_module_pattern",
    "match_module_names",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "apply_compile",
    "is_compiled",
    "apply_fsdp",
    "apply_fsdp_groups",
    "fsdp_gathered",
    "group_small_modules",
    "FSDPGroup",
    "clip_grad_norm",
    "ActivationOffload",
    "apply_activation_offload",
    "is_offloaded",
    "ShardAdamW",
    "SwapAdamW",
]
