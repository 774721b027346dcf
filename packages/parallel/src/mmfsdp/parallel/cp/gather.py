"""An autograd-aware all-gather of equally shaped tensors over a process group.

The layers with state along the sequence (`mmfsdp.model.gated_deltanet`) exchange
small per-rank summaries (a chunk's state transition, the last inputs of a
convolution) that every rank reads; the gradient each reader puts on a summary
must reach the rank that produced it. Forward: `all_gather`; backward: the
gradients of the whole stack are summed over the group (`all_reduce`) and each
rank keeps its own slice. The backward moves `world × size` elements where a
reduce-scatter would move `size`; the summaries are small, and gloo (the CPU
tests) has no reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_with_grad"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad_W: torch.Tensor):
        grad_W = grad_W.contiguous().clone()
        dist.all_reduce(grad_W, group=ctx.group)
        return grad_W[ctx.rank], None


def all_gather_with_grad(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[world, *local.shape]`: every rank's `local` in group-rank order; gradients flow back to their producer."""
    return _AllGather.apply(local, group)
