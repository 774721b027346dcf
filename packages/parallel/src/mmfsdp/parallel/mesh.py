"""The process layout: a pure, validated `MeshPlan` and the `DeviceMesh` built from it.

Flow:
1. `MeshPlan.from_config(cfg, world_size)` derives the four axis sizes from the
   `parallel:` section and the world size, raising `ConfigError` (keys
   `parallel.<key>`) before any process group exists.
2. `build_parallel_dims(plan, device_type)` creates one 4-D `DeviceMesh` with
   axes `(dp_replicate, dp_shard, ring, ulysses)` (outermost first, so a
   Ulysses group is the closest ranks: the all-to-all stays inside a node) and
   the flattened views every other package needs, in a `ParallelDims`.

Axes and views:
- `dp_replicate` — HSDP replicas; parameters are replicated across it.
- `dp_shard` — ranks that read different data and shard the parameters.
- `ring`, `ulysses` — context parallel; `cp` = ring × ulysses ranks share one
  sequence (and therefore one `dp_rank`).
- `dp_shard_cp` = dp_shard × cp — the FSDP shard group. Context-parallel ranks
  hold different tokens of the same samples and compute gradients of the same
  parameters, so they shard parameters (and average gradients) together with
  the data-parallel shards.
- `dp` = dp_replicate × dp_shard — data loading: one `dp_rank` per distinct
  stream of samples.
- `dp_cp` = everything — loss and token-count reductions.
- `ep`, `efsdp` — expert parallel (only when `expert_parallel_size` > 1):
  the FSDP shard group `dp_shard_cp` is unflattened into `(efsdp, ep)`, `ep`
  innermost. An `ep` group holds the experts of a layer between them (each
  rank `E / ep`) and exchanges tokens by all-to-all; the `efsdp` ranks hold
  the same experts and FSDP-shard them (`expert_fsdp_mesh`: 1-D `efsdp`, or
  2-D `(dp_replicate, efsdp)` for HSDP). EP therefore takes no extra ranks:
  it re-uses data- and context-parallel ranks, as in torchtitan and MindSpeed-MM.

`fsdp_mesh` is what `apply_fsdp` takes: 1-D `dp_shard_cp`, or 2-D
`(dp_replicate, dp_shard_cp)` for HSDP (FSDP2 all-reduces gradients across
the first axis and reduce-scatters across the second).

`DeviceMesh` flattening has no public API in torch 2.11–2.14; `_flatten_axes`
uses a public `flatten` when the installed torch has one and the private
`_flatten` otherwise, keeping the result (slicing a flattened axis back out of
the root mesh is deprecated). The expert meshes come from `_unflatten` in the
same way (`unflatten` where public), so they share the root mesh with the FSDP
mesh, which FSDP2 needs to shard an EP-sharded DTensor parameter.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mmfsdp.config import ConfigError
from mmfsdp.parallel.config import ParallelConfig

__all__ = ["MeshPlan", "ParallelDims", "build_parallel_dims", "MESH_AXES"]

MESH_AXES = ("dp_replicate", "dp_shard", "ring", "ulysses")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True, slots=True)
class MeshPlan:
    """Sizes of the four mesh axes (their product is the world size) and the expert-parallel size."""

    dp_replicate: int
    dp_shard: int
    ring: int
    ulysses: int
    ep: int = 1
    """Expert-parallel size: divides `fully_shard`; the experts are FSDP-sharded over `efsdp` = fully_shard / ep."""

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def fully_shard(self) -> int:
        """Size of the FSDP shard group: dp_shard × cp."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks holding the same experts (they FSDP-shard them): fully_shard / ep."""
        return self.fully_shard // self.ep

    @property
    def dp(self) -> int:
        """Number of distinct data streams: dp_replicate × dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.fully_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.ring, self.ulysses)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "MeshPlan":
        """Derive and validate the axis sizes; every mistake is a `ConfigError` keyed `parallel.<key>`."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        replicate = cfg.data_parallel_replicate_size
        if world_size % replicate:
            raise ConfigError(
                "parallel.data_parallel_replicate_size",
                f"{replicate} does not divide the world size {world_size}; use one of {_divisors(world_size)}",
            )
        fully_shard = world_size // replicate
        if cfg.fully_shard_parallel_size != "auto":
            if replicate * cfg.fully_shard_parallel_size != world_size:
                raise ConfigError(
                    "parallel.fully_shard_parallel_size",
                    f"{cfg.fully_shard_parallel_size} × data_parallel_replicate_size {replicate} = "
                    f"{cfg.fully_shard_parallel_size * replicate} ranks, but the world size is {world_size}; "
                    f"set it to {fully_shard} or 'auto'",
                )
        ulysses, ring = cfg.ulysses_parallel_size, cfg.ring_attention_size
        if fully_shard % ulysses:
            raise ConfigError(
                "parallel.ulysses_parallel_size",
                f"{ulysses} does not divide fully_shard_parallel_size {fully_shard} (world size {world_size}); "
                f"use one of {_divisors(fully_shard)}",
            )
        if fully_shard % (ring * ulysses):
            raise ConfigError(
                "parallel.ring_attention_size",
                f"ring_attention_size {ring} × ulysses_parallel_size {ulysses} = {ring * ulysses} does not divide "
                f"fully_shard_parallel_size {fully_shard} (world size {world_size}); "
                f"use a ring size among {_divisors(fully_shard // ulysses)}",
            )
        ep = cfg.expert_parallel_size
        if fully_shard % ep:
            raise ConfigError(
                "parallel.expert_parallel_size",
                f"{ep} does not divide the FSDP shard group of {fully_shard} ranks (fully_shard_parallel_size; world size "
                f"{world_size}): expert parallel is carved out of it; use one of {_divisors(fully_shard)}",
            )
        return cls(dp_replicate=replicate, dp_shard=fully_shard // (ring * ulysses), ring=ring, ulysses=ulysses, ep=ep)


def _flatten_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    sub = mesh[axes]
    public = getattr(sub, "flatten", None)
    return public(name) if public is not None else sub._flatten(name)


def _unflatten_axis(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    public = getattr(mesh, "unflatten", None)
    private = getattr(mesh, "_unflatten", None)
    if public is None and private is None:
        raise ConfigError(
            "parallel.expert_parallel_size",
            f"expert parallel needs DeviceMesh unflattening, which this torch ({torch.__version__}) lacks; "
            "upgrade torch or set expert_parallel_size: 1",
        )
    return public(0, sizes, names) if public is not None else private(0, sizes, names)


def _hsdp_mesh(world_mesh: DeviceMesh, shard: DeviceMesh, shard_name: str = "dp_shard_cp") -> DeviceMesh:
    """The 2-D (dp_replicate, shard) mesh, reusing the groups already created."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([world_mesh["dp_replicate"], shard])
    with warnings.catch_warnings():  # torch without `_concatenate`: slicing a flattened axis is the only way
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return world_mesh[("dp_replicate", shard_name)]


@dataclass(frozen=True, slots=True, eq=False)
class ParallelDims:
    """The world mesh, its flattened views and this rank's coordinates."""

    plan: MeshPlan
    world_mesh: DeviceMesh
    cp_mesh: DeviceMesh
    dp_shard_cp_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    dp_cp_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    ep_mesh: DeviceMesh | None = None
    """1-D `ep` mesh (expert parallel > 1 only): the ranks that split the experts of a layer."""
    expert_fsdp_mesh: DeviceMesh | None = None
    """What FSDP2 shards the experts over (expert parallel > 1 only): `efsdp`, or `(dp_replicate, efsdp)` for HSDP."""

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def dp_replicate(self) -> int:
        return self.plan.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.plan.dp_shard

    @property
    def ring_size(self) -> int:
        return self.plan.ring

    @property
    def ulysses_size(self) -> int:
        return self.plan.ulysses

    @property
    def dp_size(self) -> int:
        return self.plan.dp

    @property
    def cp_size(self) -> int:
        return self.plan.cp

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data stream; equal on all ranks of one CP group."""
        return self.dp_mesh.get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank()

    @property
    def ring_rank(self) -> int:
        return self.world_mesh.get_local_rank("ring")

    @property
    def ulysses_rank(self) -> int:
        return self.world_mesh.get_local_rank("ulysses")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp_mesh.get_group()

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.world_mesh.get_group("ulysses")

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self.world_mesh.get_group("ring")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def ep_size(self) -> int:
        return self.plan.ep

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_mesh is None else self.ep_mesh.get_local_rank()


def build_parallel_dims(plan: MeshPlan, device_type: str) -> ParallelDims:
    """Create the 4-D mesh for `plan` on an initialised default process group."""
    if not dist.is_initialized():
        raise RuntimeError("build_parallel_dims needs a process group: call mmfsdp.parallel.init_process_group first")
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"the mesh plan is for {plan.world_size} ranks but the process group has {dist.get_world_size()}")
    world_mesh = init_device_mesh(device_type, plan.shape, mesh_dim_names=MESH_AXES)
    dp_shard_cp = _flatten_axes(world_mesh, ("dp_shard", "ring", "ulysses"), "dp_shard_cp")
    ep_mesh = expert_fsdp_mesh = None
    if plan.ep > 1:
        sparse = _unflatten_axis(dp_shard_cp, (plan.efsdp, plan.ep), ("efsdp", "ep"))
        ep_mesh, efsdp = sparse["ep"], sparse["efsdp"]
        expert_fsdp_mesh = efsdp if plan.dp_replicate == 1 else _hsdp_mesh(world_mesh, efsdp, "efsdp")
    return ParallelDims(
        plan=plan,
        world_mesh=world_mesh,
        cp_mesh=_flatten_axes(world_mesh, ("ring", "ulysses"), "cp"),
        dp_shard_cp_mesh=dp_shard_cp,
        dp_mesh=_flatten_axes(world_mesh, ("dp_replicate", "dp_shard"), "dp"),
        dp_cp_mesh=_flatten_axes(world_mesh, MESH_AXES, "dp_cp"),
        fsdp_mesh=dp_shard_cp if plan.dp_replicate == 1 else _hsdp_mesh(world_mesh, dp_shard_cp),
        ep_mesh=ep_mesh,
        expert_fsdp_mesh=expert_fsdp_mesh,
    )
