"""The `parallel:` config section: mesh sizes, the FSDP2 plan and the recompute plan.

Only per-field checks live here. Whether the sizes fit a world size is checked by
`mmfsdp.parallel.mesh.MeshPlan.from_config`, which needs the world size and runs
before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from mmfsdp.config import ConfigError, ForeignKey, Ignored

__all__ = ["ParallelConfig", "FSDPPlanConfig", "RecomputePlanConfig", "EPPlanConfig"]

DType = Literal["fp32", "bf16", "fp16"]


@dataclass(kw_only=True, slots=True)
class FSDPPlanConfig:
    """Which modules `fully_shard` wraps and how (YAML `parallel.fsdp_plan:`)."""

    apply_modules: list[str] | None = None
    """Module name patterns to wrap with `fully_shard`, e.g. `model.language_model.layers.{*}`; null = the model's default list."""
    ignored_modules: list[str] = field(default_factory=list)
    """Module name patterns whose parameters FSDP leaves unsharded and unsynchronised (freeze them)."""
    param_dtype: DType | None = None
    """Dtype the parameters are all-gathered in for compute; null = keep the parameters' own dtype."""
    reduce_dtype: DType | None = "fp32"
    """Dtype gradients are reduce-scattered in; null = the compute dtype."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward and gather again in backward (less memory, more communication); the root's group and the last group in model order always keep theirs (backward needs them first)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states on the CPU."""
    num_to_forward_prefetch: int = 0
    """How many following wrapped modules each wrapped module starts gathering during forward."""
    num_to_backward_prefetch: int = 0
    """How many preceding wrapped modules each wrapped module starts gathering during backward."""
    min_group_params: int = 4_000_000
    """Fewer parameters than this per FSDP2 group: consecutive entries of one module list (decoder layers, vision blocks) are sharded together until a group holds this many, and a smaller matched module outside a list, or a whole list smaller than this, joins the root's group (one all-gather and reduce-scatter for many small layers: the same numbers, less time per collective); 0 = one group per matched module."""

    direct_cpu_comm: bool = True
    """On a gloo (CPU) process group, run FSDP2's all-gather and reduce-scatter as direct point-to-point exchanges (each rank sends each peer its part once) instead of gloo's collectives, which copy and move every byte about twice: about 2x faster on 2 ranks, bitwise the same values there (on more ranks the reduce-scatter sums in rank order). No effect on NCCL / HCCL."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "hook_modules": Ignored(
            "prefetching follows the order of the FSDP2 groups (num_to_forward_prefetch / num_to_backward_prefetch)"
        ),
    }

    def __post_init__(self) -> None:
        for key in ("num_to_forward_prefetch", "num_to_backward_prefetch", "min_group_params"):
            value = getattr(self, key)
            if value < 0:
                off = "one group per matched module" if key == "min_group_params" else "explicit prefetching off"
                raise ConfigError(key, f"must be >= 0, got {value}; 0 turns {off}")


@dataclass(kw_only=True, slots=True)
class RecomputePlanConfig:
    """Which modules recompute their activations in backward (YAML `parallel.recompute_plan:`)."""

    apply_modules: list[str] | None = None
    """Module name patterns to checkpoint, e.g. `model.language_model.layers.{*}`; null = the model's default list."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "use_reentrant": Ignored("activation checkpointing is always the non-reentrant kind", allowed=(False,)),
    }


@dataclass(kw_only=True, slots=True)
class EPPlanConfig:
    """Which modules expert parallel shards (YAML `parallel.ep_plan:`)."""

    apply_modules: list[str] | None = None
    """Module name patterns of the MoE expert modules (fused `gate_up_proj` / `down_proj`), e.g. `model.language_model.layers.{*}.mlp.experts`; null = the model's default list."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "dispatcher": Ignored("expert parallel sends tokens to their experts with all-to-all", allowed=("alltoall",)),
    }


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Process layout and sharding (YAML `parallel:`)."""

    fully_shard_parallel_size: int | Literal["auto"] = "auto"
    """Ranks in one FSDP shard group (data-parallel shards × context-parallel size); auto = world size / data_parallel_replicate_size."""
    data_parallel_replicate_size: int = 1
    """Number of HSDP replicas; each holds a full copy of the sharded model."""
    ulysses_parallel_size: int = 1
    """Ulysses (all-to-all over heads) context-parallel size."""
    ring_attention_size: int = 1
    """Ring-attention context-parallel size."""
    vision_dp: bool = True
    """Under context parallel, each rank of a CP group encodes a cost-balanced share of the micro-batch's images, videos and audio clips and the features are all-gathered (docs/parallelism.md, "Vision data parallel"); on by default since its parity through the trainer is proven (tests/test_e2e_text_only_parity.py, tests/test_e2e_qwen3omni_parity.py). false = every CP rank encodes every media item."""
    tensor_parallel_size: int = 1
    """Must be 1: tensor parallelism is not supported."""
    expert_parallel_size: int = 1
    """Ranks that split the experts of every MoE layer (each holds num_experts / this many); carved out of the FSDP shard group, so it must divide fully_shard_parallel_size. 1 = every rank holds every expert. MoE models only."""
    ep_plan: EPPlanConfig = field(default_factory=EPPlanConfig)
    """Which modules expert parallel shards."""
    fsdp_plan: FSDPPlanConfig = field(default_factory=FSDPPlanConfig)
    """How FSDP2 wraps the model."""
    recompute: bool = False
    """Recompute activations of the modules in `recompute_plan` during backward."""
    recompute_plan: RecomputePlanConfig = field(default_factory=RecomputePlanConfig)
    """Which modules recompute their activations when `recompute` is true."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before it fails (the process group timeout; > 0)."""
    heartbeat_timeout_s: float = 600.0
    """Seconds without training-step progress after which a rank writes where it waits (stderr and `<output_dir>/hang_rank<r>.txt`) and exits; 0 = off. Not armed during start-up, the first step, saves and the final evaluation (docs/reliability.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.collective_timeout_s, bool) or not self.collective_timeout_s > 0:
            raise ConfigError("collective_timeout_s", f"must be > 0 seconds, got {self.collective_timeout_s!r}")
        if isinstance(self.heartbeat_timeout_s, bool) or not self.heartbeat_timeout_s >= 0:
            raise ConfigError("heartbeat_timeout_s", f"must be >= 0 seconds (0 turns the heartbeat off), got {self.heartbeat_timeout_s!r}")
        fully_shard = self.fully_shard_parallel_size
        if fully_shard != "auto" and (isinstance(fully_shard, bool) or not isinstance(fully_shard, int) or fully_shard < 1):
            raise ConfigError("fully_shard_parallel_size", f"must be 'auto' or an integer >= 1, got {fully_shard!r}")
        for key in ("data_parallel_replicate_size", "ulysses_parallel_size", "ring_attention_size", "expert_parallel_size"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(key, f"must be >= 1, got {value}; use 1 to turn this axis off")
        if self.tensor_parallel_size != 1:
            raise ConfigError(
                "tensor_parallel_size",
                f"{self.tensor_parallel_size} is not supported: tensor parallelism is not implemented; "
                "set it to 1 and scale with fully_shard_parallel_size (FSDP) or "
                "ulysses_parallel_size / ring_attention_size (context parallel)",
            )
