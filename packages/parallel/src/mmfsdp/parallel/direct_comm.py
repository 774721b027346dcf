"""FSDP2's all-gather and reduce-scatter as direct point-to-point exchanges on a gloo (CPU) process group.

gloo has no native reduce-scatter (torch clones the input, all-reduces all of it and copies one chunk out) and
its all-gather copies the input and moves every byte through its own algorithm; on 2 ranks both take about
twice as long as sending each peer its part once (56 MB: reduce-scatter 84 → 31 ms, all-gather 70 → 30 ms on
the 2-core CI machine, `docs/parallelism.md`). Here each rank sends every peer the chunk that peer owns
(reduce-scatter) or its own shard (all-gather) with `isend` / `irecv`, all posted before any is waited on.

Values: the all-gather moves bytes, so it is exact. The reduce-scatter sums each chunk on its owner in rank
order (rank 0's part + rank 1's + ...), then divides for `AVG`: on 2 ranks that is the same sum gloo computes,
bitwise; on more ranks the order of the additions may differ from gloo's ring (a rounding-level difference,
as between any two collective algorithms). Any other reduce op goes to torch's own reduce-scatter.

`install_direct_comm(module, group)` sets them on an FSDP2 module (`FSDPModule.set_custom_all_gather` /
`set_custom_reduce_scatter`, torch >= 2.8) whose process group is gloo; on other backends (NCCL, HCCL), on a
torch without those hooks and on a group of one rank it leaves FSDP2's own collectives. It returns whether it
installed them. Both run synchronously (on the CPU there is no separate stream to overlap them with) and return
no `Work`, which FSDP2 reads as "already done".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DirectAllGather", "DirectReduceScatter", "install_direct_comm", "supports_direct_comm"]

_ALL_GATHER_TAG = 0x4D41  # distinct tags keep the two kinds of exchange apart on a pair of ranks
_REDUCE_SCATTER_TAG = 0x4D52

try:  # torch >= 2.8: FSDP2's comm interfaces
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch: FSDP2 keeps its own collectives
    _AllGatherBase = _ReduceScatterBase = object


def _peers(group: dist.ProcessGroup) -> tuple[int, int, list[int]]:
    rank, size = group.rank(), group.size()
    return rank, size, [dist.get_global_rank(group, r) for r in range(size)]


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class DirectAllGather(_Alloc, _AllGatherBase):
    """`output = cat(input of every rank)`: each rank sends its shard to every peer and receives theirs into
    their slices of `output` (its own slice is `input`, written there by FSDP2's copy-in, or copied)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        rank, size, global_ranks = _peers(group)
        chunks = output_tensor.chunk(size)
        if chunks[rank].data_ptr() != input_tensor.data_ptr():
            chunks[rank].copy_(input_tensor)
        works = []
        for peer in range(size):
            if peer != rank:
                works.append(dist.isend(input_tensor, global_ranks[peer], group=group, tag=_ALL_GATHER_TAG))
                works.append(dist.irecv(chunks[peer], global_ranks[peer], group=group, tag=_ALL_GATHER_TAG))
        _wait(works)
        return None


class DirectReduceScatter(_Alloc, _ReduceScatterBase):
    """`output = op over ranks of (input of that rank).chunk(size)[rank]` for SUM and AVG: each rank sends
    chunk `j` to rank `j` and sums the chunks it receives in rank order. Other ops: torch's reduce-scatter."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        rank, size, global_ranks = _peers(group)
        chunks = input_tensor.chunk(size)
        received: dict[int, torch.Tensor] = {}
        works = []
        for peer in range(size):
            if peer != rank:
                received[peer] = torch.empty_like(chunks[peer])
                works.append(dist.isend(chunks[peer], global_ranks[peer], group=group, tag=_REDUCE_SCATTER_TAG))
                works.append(dist.irecv(received[peer], global_ranks[peer], group=group, tag=_REDUCE_SCATTER_TAG))
        _wait(works)
        parts = [chunks[rank] if r == rank else received[r] for r in range(size)]
        torch.add(parts[0], parts[1], out=output_tensor)
        for part in parts[2:]:
            output_tensor.add_(part)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(size)
        return None


def supports_direct_comm(group: dist.ProcessGroup | None) -> bool:
    """Whether the direct exchanges apply to `group`: a gloo group of 2+ ranks on a torch with FSDP2's hooks."""
    if group is None or _AllGatherBase is object or group.size() < 2:
        return False
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def install_direct_comm(module: nn.Module, group: dist.ProcessGroup | None) -> bool:
    """Set the direct all-gather and reduce-scatter on the FSDP2 module `module` sharded over `group`, when
    `supports_direct_comm(group)` and FSDP2 offers the hooks; return whether they were set."""
    if not supports_direct_comm(group):
        return False
    if not (hasattr(module, "set_custom_all_gather") and hasattr(module, "set_custom_reduce_scatter")):
        return False
    try:
        module.set_custom_all_gather(DirectAllGather())
        module.set_custom_reduce_scatter(DirectReduceScatter())
    except ValueError:  # FSDP2 refuses a custom comm for a module with several parameter groups
        return False
    return True
