"""Summing the per-shard loss over the context-parallel group with the right gradients.

Each CP rank computes `Σ_t w_t · CE_t` over its own tokens, where the weights
`w_t` already carry the global normaliser (trained tokens over all
data-parallel ranks and gradient-accumulation steps, see the model's loss
types), so the sum over every token of the step *is* the loss. The total over
the CP group is then `L = Σ_r l_r`.

Every rank calls `backward()` on its copy of `L`. The gradient of `L` with
respect to rank r's local loss is 1, so the backward of the sum must hand each
rank's local loss a gradient of exactly 1. An autograd all-reduce (whose
backward all-reduces the incoming gradients) would give CP instead, because all
CP ranks seed their backward with 1. `cp_loss_reduce` therefore all-reduces in
forward and passes the gradient through unchanged in backward.

Cross-rank dependencies (a rank's K/V feeding another rank's attention) are not
the loss's business: the Ulysses all-to-all and the ring backward send those
gradients back to the owning rank. After backward, each rank's parameter
gradients are its share of the full gradient; summing them over the CP group —
which FSDP2's reduce-scatter over `dp_shard_cp` does — gives the unsplit
model's gradient. (FSDP2 averages by default: the trainer undoes that factor,
or the loss weights include it.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["cp_loss_reduce"]


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group):
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cp_loss_reduce(local_loss_sum: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The loss summed over the CP group; its backward gives each rank's local loss a gradient of 1."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return local_loss_sum
    return _SumOverGroup.apply(local_loss_sum, cp_group)
