"""Ulysses sequence parallelism: all-to-all from sequence-sharded to head-sharded and back.

Flow inside one attention call, Ulysses group of size U:
1. q/k/v arrive sequence-sharded, `(B, S/U, H, D)`: rank u holds piece u of the
   (ring-local) sequence and every head.
2. GQA: when the K/V heads do not split evenly into U groups, each K/V head is
   repeated just enough (to lcm(K, U) heads) that every rank gets whole K/V
   heads matching its query heads; the repeat is part of autograd, so the
   gradients of the copies are summed back.
3. `seq_to_heads`: one all-to-all per tensor gives `(B, S, H/U, D)`: the whole
   sequence for H/U heads (rank u gets heads u·H/U … (u+1)·H/U − 1).
4. `attn_fn` runs on that — plain local attention, or ring attention over the
   ring group for Hybrid (the ring then passes head-sharded K/V).
5. `heads_to_seq` turns the output back into `(B, S/U, H, D)`.
The backward of each all-to-all is the opposite all-to-all.

Shape legend: B batch, S tokens (local: S/U), H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from mmfsdp.parallel.cp.validate import validate_ulysses_heads

__all__ = ["heads_to_seq", "repeat_kv_for_ulysses", "seq_to_heads", "ulysses_attention"]


def _seq_to_heads(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    U = dist.get_world_size(group)
    B, S_local, H, D = x_BSHD.shape
    send = x_BSHD.reshape(B, S_local, U, H // U, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[u] is rank u's sequence piece of this rank's heads
    return recv.permute(1, 0, 2, 3, 4).reshape(B, U * S_local, H // U, D)


def _heads_to_seq(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    U = dist.get_world_size(group)
    B, S, H_local, D = x_BSHD.shape
    send = x_BSHD.reshape(B, U, S // U, H_local, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[u] is rank u's heads of this rank's sequence piece
    return recv.permute(1, 2, 0, 3, 4).reshape(B, S // U, U * H_local, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSHD, group):
        ctx.group = group
        return _seq_to_heads(x_BSHD, group)

    @staticmethod
    def backward(ctx, grad_BSHD):
        return _heads_to_seq(grad_BSHD, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSHD, group):
        ctx.group = group
        return _heads_to_seq(x_BSHD, group)

    @staticmethod
    def backward(ctx, grad_BSHD):
        return _seq_to_heads(grad_BSHD, ctx.group), None


def seq_to_heads(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`(B, S/U, H, D)` sequence-sharded → `(B, S, H/U, D)` head-sharded (autograd-aware)."""
    assert x_BSHD.size(2) % dist.get_world_size(group) == 0, (x_BSHD.shape, dist.get_world_size(group))
    return _SeqToHeads.apply(x_BSHD, group)


def heads_to_seq(x_BSHD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`(B, S, H/U, D)` head-sharded → `(B, S/U, H, D)` sequence-sharded (autograd-aware)."""
    assert x_BSHD.size(1) % dist.get_world_size(group) == 0, (x_BSHD.shape, dist.get_world_size(group))
    return _HeadsToSeq.apply(x_BSHD, group)


def repeat_kv_for_ulysses(x_BSKD: torch.Tensor, num_heads: int, ulysses_size: int) -> torch.Tensor:
    """Repeat each K/V head so the K/V heads split into `ulysses_size` groups aligned with the query heads."""
    K = x_BSKD.size(2)
    repeats = math.lcm(K, ulysses_size) // K
    assert num_heads % (K * repeats) == 0, (num_heads, K, ulysses_size)
    return x_BSKD if repeats == 1 else x_BSKD.repeat_interleave(repeats, dim=2)


def ulysses_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    attn_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Attention over the Ulysses group's whole sequence; inputs and output are sequence-sharded.

    `attn_fn(q, k, v)` receives head-sharded `(B, S, H/U, D)` tensors (K/V with
    their heads possibly repeated for GQA) and returns the output in that layout.
    """
    U = dist.get_world_size(group)
    H = q_BSHD.size(2)
    validate_ulysses_heads(H, k_BSKD.size(2), U)
    k_BSKD = repeat_kv_for_ulysses(k_BSKD, H, U)
    v_BSKD = repeat_kv_for_ulysses(v_BSKD, H, U)
    out = attn_fn(seq_to_heads(q_BSHD, group), seq_to_heads(k_BSKD, group), seq_to_heads(v_BSKD, group))
    return heads_to_seq(out, group)
