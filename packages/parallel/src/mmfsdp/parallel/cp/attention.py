"""One entry point for decoder attention under context parallel: Ulysses, Ring or Hybrid.

`context_parallel_attention(q, k, v, layout, ring_group=..., ulysses_group=...)`
takes this rank's sequence shard (as produced by `split_for_cp` with the same
`layout`) and returns this rank's shard of the attention output:

- Ulysses only (ring size 1): all-to-all to head shards, local attention over
  the whole sequence, all-to-all back.
- Ring only (Ulysses size 1): load-balanced ring attention over the ring group.
- Hybrid (both > 1): Ulysses inside, ring across — after the Ulysses all-to-all
  every rank holds its ring rank's ring-local sequence for H/U heads, and the
  ring passes those head-sharded K/V among the ranks with the same Ulysses rank.
- Neither: plain local attention through the same kernel.

Packed batches keep their samples apart everywhere (`layout.local_cu_seq_lens()`).

Shape legend: B batch, S local tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmfsdp.parallel.cp.kernels import AttentionKernel
from mmfsdp.parallel.cp.layout import CPLayout
from mmfsdp.parallel.cp.ring import RingHalves, ring_attention
from mmfsdp.parallel.cp.ulysses import ulysses_attention

__all__ = ["context_parallel_attention", "ring_halves"]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def ring_halves(layout: CPLayout, device: torch.device) -> RingHalves | None:
    """The `RingHalves` every ring attention call of a batch with this layout reads (None without a ring)."""
    if layout.ring_size == 1:
        return None
    return RingHalves(layout.seq_len // layout.ring_size, layout.local_cu_seq_lens(), device)


def context_parallel_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    layout: CPLayout,
    *,
    ring_group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    halves: RingHalves | None = None,
) -> torch.Tensor:
    """Attention of this rank's tokens over the whole (per-sample) sequence; returns this rank's output shard.
    `halves`: the ring's `RingHalves` of `layout` (`ring_halves(layout, device)`), made once per micro-batch."""
    assert _group_size(ring_group) == layout.ring_size and _group_size(ulysses_group) == layout.ulysses_size, (
        _group_size(ring_group), _group_size(ulysses_group), layout,
    )
    assert q_BSHD.size(1) == layout.local_seq_len, (q_BSHD.shape, layout.local_seq_len)
    cu_seq_lens = layout.local_cu_seq_lens()
    ring = ring_group if layout.ring_size > 1 else None

    def attend(q, k, v):
        return ring_attention(
            q, k, v, ring, cu_seq_lens=cu_seq_lens, causal=causal, scale=scale, kernel=kernel, halves=halves
        )

    if layout.ulysses_size > 1:
        return ulysses_attention(q_BSHD, k_BSKD, v_BSKD, attend, ulysses_group)
    return attend(q_BSHD, k_BSKD, v_BSKD)
