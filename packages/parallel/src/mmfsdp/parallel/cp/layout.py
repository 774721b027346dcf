"""Which tokens each context-parallel rank holds: the load-balanced (zigzag) split.

Pure functions and one frozen dataclass; nothing here talks to a process group
except `gather_from_cp`.

Layout, for ring size R and Ulysses size U (CP rank = ring_rank · U + ulysses_rank,
the order of the mesh's flattened `cp` axis):

1. Every sample (the whole sequence, or each packed sample of `cu_seq_lens`) is
   cut into 2·R equal chunks. Ring rank r holds chunks r and 2R−1−r of every
   sample, in sample order: `[s0 c_r, s0 c_{2R-1-r}, s1 c_r, s1 c_{2R-1-r}, ...]`.
   Under causal attention chunk r is cheap (it sees little) and chunk 2R−1−r is
   expensive, so every ring rank does the same work. With R = 1 a rank holds
   the whole sample.
2. The ring-local sequence of step 1 is cut contiguously into U pieces; Ulysses
   rank u holds piece u. The Ulysses all-to-all concatenates the pieces in rank
   order, so after it every Ulysses rank sees exactly the ring-local sequence
   (with a subset of the heads) and the ring algorithm needs no reordering.

Hence every sample length must be a multiple of `required_multiple(R, U)`
(2·R·U for R > 1, else U); the collator pads each sample to it.
`CPLayout.local_cu_seq_lens` gives the sample boundaries of the ring-local
sequence, which is what the attention after the Ulysses exchange works on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CPLayout",
    "gather_from_cp",
    "merge_cp_shards",
    "required_multiple",
    "split_for_cp",
    "to_device_async",
    "zigzag_chunks",
]


def required_multiple(ring_size: int, ulysses_size: int) -> int:
    """The multiple every sample length must have: 2·ring·ulysses with a ring, else ulysses."""
    return 2 * ring_size * ulysses_size if ring_size > 1 else ulysses_size


def zigzag_chunks(ring_size: int, ring_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2·ring_size per sample) that `ring_rank` holds."""
    assert 0 <= ring_rank < ring_size, (ring_rank, ring_size)
    return ring_rank, 2 * ring_size - 1 - ring_rank


def _lengths(cu_seq_lens: Sequence[int]) -> list[int]:
    return [end - start for start, end in zip(cu_seq_lens[:-1], cu_seq_lens[1:])]


@lru_cache(maxsize=64)
def _token_indices(cu_seq_lens: tuple[int, ...], ring_size: int, ring_rank: int, ulysses_size: int, ulysses_rank: int) -> torch.Tensor:
    pieces = []
    for start, length in zip(cu_seq_lens[:-1], _lengths(cu_seq_lens)):
        if ring_size == 1:
            pieces.append(torch.arange(start, start + length))
            continue
        chunk = length // (2 * ring_size)
        for c in zigzag_chunks(ring_size, ring_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    ring_local = torch.cat(pieces)
    piece = ring_local.numel() // ulysses_size
    return ring_local[ulysses_rank * piece : (ulysses_rank + 1) * piece]


@dataclass(frozen=True, slots=True)
class CPLayout:
    """The split of one batch's sequence dimension for one CP rank.

    `cu_seq_lens` are the sample boundaries along the sequence dimension of the
    full batch (`(0, seq_len)` for an unpacked batch); `packed` says whether the
    attention must keep samples apart (varlen) or may treat the rows as dense.
    """

    cu_seq_lens: tuple[int, ...]
    packed: bool
    ring_size: int = 1
    ring_rank: int = 0
    ulysses_size: int = 1
    ulysses_rank: int = 0

    def __post_init__(self) -> None:
        multiple = required_multiple(self.ring_size, self.ulysses_size)
        for i, length in enumerate(_lengths(self.cu_seq_lens)):
            if length <= 0 or length % multiple:
                what = f"sample {i} of the packed batch" if self.packed else "the sequence"
                raise ValueError(
                    f"context parallel (ring {self.ring_size} × ulysses {self.ulysses_size}) needs every sample "
                    f"length to be a positive multiple of {multiple}, but {what} has {length} tokens; "
                    f"pad each sample to a multiple of {multiple}"
                )

    @classmethod
    def create(
        cls,
        seq_len: int,
        cu_seq_lens: torch.Tensor | Sequence[int] | None = None,
        *,
        ring_size: int = 1,
        ring_rank: int = 0,
        ulysses_size: int = 1,
        ulysses_rank: int = 0,
    ) -> "CPLayout":
        """The layout of a batch with `seq_len` tokens per row, packed when `cu_seq_lens` is given."""
        if cu_seq_lens is None:
            bounds: tuple[int, ...] = (0, seq_len)
        else:
            bounds = tuple(int(x) for x in (cu_seq_lens.tolist() if torch.is_tensor(cu_seq_lens) else cu_seq_lens))
            if bounds[0] != 0 or bounds[-1] != seq_len:
                raise ValueError(f"cu_seq_lens must run from 0 to the sequence length {seq_len}, got {bounds[0]}..{bounds[-1]}")
        return cls(bounds, cu_seq_lens is not None, ring_size, ring_rank, ulysses_size, ulysses_rank)

    @property
    def cp_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def cp_rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    @property
    def seq_len(self) -> int:
        return self.cu_seq_lens[-1]

    @property
    def local_seq_len(self) -> int:
        return self.seq_len // self.cp_size

    def for_cp_rank(self, cp_rank: int) -> "CPLayout":
        """The same split as seen by another rank of the CP group."""
        ring_rank, ulysses_rank = divmod(cp_rank, self.ulysses_size)
        return CPLayout(self.cu_seq_lens, self.packed, self.ring_size, ring_rank, self.ulysses_size, ulysses_rank)

    def token_indices(self) -> torch.Tensor:
        """Positions (into the full sequence) of this rank's tokens, in local order."""
        return _token_indices(self.cu_seq_lens, self.ring_size, self.ring_rank, self.ulysses_size, self.ulysses_rank)

    def local_cu_seq_lens(self) -> tuple[int, ...] | None:
        """Sample boundaries of the ring-local sequence (what attention sees after Ulysses); None if unpacked."""
        if not self.packed:
            return None
        bounds = [0]
        for length in _lengths(self.cu_seq_lens):
            bounds.append(bounds[-1] + length // self.ring_size)
        return tuple(bounds)


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; on an accelerator copied from pinned memory without waiting (the host goes on,
    the copy is ordered before later work on the device's stream)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def split_for_cp(tensor: torch.Tensor, layout: CPLayout, dim: int = 1, index: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's tokens of `tensor` along `dim` (inputs, position_ids, labels, loss weights). `index`: the
    layout's `token_indices()` already on `tensor`'s device (made once per batch); None: copied there here."""
    if tensor.size(dim) != layout.seq_len:
        raise ValueError(f"dimension {dim} has {tensor.size(dim)} tokens, the layout expects {layout.seq_len}")
    if index is None:
        index = layout.token_indices().to(tensor.device)
    return tensor.index_select(dim, index)


def merge_cp_shards(shards: Sequence[torch.Tensor], layout: CPLayout, dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp`: the full tensor from every CP rank's shard (in CP-rank order)."""
    assert len(shards) == layout.cp_size, (len(shards), layout.cp_size)
    index = torch.cat([layout.for_cp_rank(r).token_indices() for r in range(layout.cp_size)])
    stacked = torch.cat(list(shards), dim)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return stacked.index_select(dim, inverse.to(stacked.device))


def gather_from_cp(tensor: torch.Tensor, layout: CPLayout, cp_group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard over `cp_group` and return the full tensor (no autograd)."""
    shards = [torch.empty_like(tensor) for _ in range(layout.cp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=cp_group)
    return merge_cp_shards(shards, layout, dim)
