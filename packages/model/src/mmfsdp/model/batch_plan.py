"""The plan of one micro-batch: what the decoder layers read, worked out once on the host before the forward.

The layers of a packed or context-parallel forward need the batch's sample boundaries as host numbers (to loop,
split and size) and as device index tensors (to gather and regroup). Read from a device tensor in every layer,
each boundary read stops the host until the device has caught up, and every index tensor built from a Python list
is one more copy from pageable memory. So the training forward (`TrainingForwardMixin.forward`) builds one
`BatchPlan` per micro-batch before the decoder runs:

1. The host bounds, from the collator's `cu_seq_lens`: the trainer keeps them on the host (`HOST_INPUT_KEYS`),
   so reading them costs nothing; given on the device they are read once (one round trip per micro-batch).
2. On the host: the attention's per-sample segments (`mmfsdp.model.attention.row_segments`); under context
   parallel this rank's token indices (`CPBatch.split`) and the ring's halves (`mmfsdp.parallel.cp.RingHalves`);
   and what the family's layers declare (`TrainingForwardMixin.plan_layers`: Qwen3.5's Gated DeltaNet segments,
   `mmfsdp.model.gated_deltanet.plan_gated_deltanet`), kept in `layers` by name.
3. Every tensor goes to the device from pinned memory without waiting (`mmfsdp.parallel.cp.to_device_async`).
4. The plan reaches every decoder layer as one keyword (`BATCH_PLAN_KEY`, which the decoder layers pass to their
   attention and token mixers), beside HF's varlen keywords, whose `cu_seq_lens_q/k` is the plan's device copy.

The layers only read it: their host round trips are zero, so the count per micro-batch does not grow with depth
(`mmfsdp.model.host_syncs` counts them; tests/test_host_syncs.py checks it). Under activation checkpointing the
recomputed layer gets the same keywords, hence the same plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mmfsdp.model.host_syncs import host_side
from mmfsdp.parallel.cp import RingHalves, ring_halves, to_device_async

__all__ = ["BATCH_PLAN_KEY", "HOST_INPUT_KEYS", "BatchPlan", "host_bounds", "row_segments", "segments_of"]

BATCH_PLAN_KEY = "mmfsdp_batch_plan"
"""The decoder keyword that carries the `BatchPlan` to every layer."""
HOST_INPUT_KEYS = ("cu_seq_lens",)
"""Model inputs a trainer leaves on the host when it moves a batch to the device: the plan reads them there."""


def host_bounds(cu_seq_lens: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    """The sample bounds as host integers: free for a host tensor or a sequence, one round trip from the device."""
    if not torch.is_tensor(cu_seq_lens):
        return tuple(int(x) for x in cu_seq_lens)
    if cu_seq_lens.device.type == "cpu":
        with host_side():
            return tuple(cu_seq_lens.reshape(-1).tolist())
    return tuple(cu_seq_lens.reshape(-1).tolist())


def row_segments(bounds: Sequence[int], batch_size: int, seq_len: int) -> list[tuple[int, int]] | None:
    """The `[start, end)` token ranges of the packed sequences over the flattened `B·S` tokens, from host bounds
    (tokens after the last boundary form one more, as in `mmfsdp.model.attention.varlen_block_mask`); None when one
    would cross a row."""
    num_tokens = batch_size * seq_len
    cuts = sorted({min(max(int(v), 0), num_tokens) for v in bounds} | {0, num_tokens})
    segments = [(start, end) for start, end in zip(cuts, cuts[1:]) if end > start]
    if any(start // seq_len != (end - 1) // seq_len for start, end in segments):
        return None
    return segments


_SEGMENTS = WeakIdKeyDictionary()  # cu_seq_lens tensor -> ((B, S, version), segments)


def segments_of(cu_seq_lens: torch.Tensor, batch_size: int, seq_len: int) -> list[tuple[int, int]] | None:
    """`row_segments` of a `cu_seq_lens` tensor, read to the host once per tensor: a plan's device copy was
    registered with its host segments when the plan was made (no read at all), and a call without a plan gets the
    same tensor in every layer."""
    cached = _SEGMENTS.get(cu_seq_lens)
    if cached is not None and cached[0] == (batch_size, seq_len, cu_seq_lens._version):
        return cached[1]
    segments = row_segments(host_bounds(cu_seq_lens), batch_size, seq_len)
    _SEGMENTS[cu_seq_lens] = ((batch_size, seq_len, cu_seq_lens._version), segments)
    return segments


class BatchPlan:
    """One micro-batch's plan (module docstring): `bounds` (host, over the flattened `B·S` tokens; None for rows of
    one sample each), `cu_seq_lens` (int32, on the device), `max_length`, `attention_segments` (host `[start, end)`
    per sample, None when one would cross a row), `ring_halves` (context parallel with a ring), `layers` (the
    family's layer plans, by name)."""

    __slots__ = ("batch_size", "seq_len", "device", "bounds", "cu_seq_lens", "max_length", "attention_segments",
                 "ring_halves", "layers")

    def __init__(
        self,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        cu_seq_lens: torch.Tensor | Sequence[int] | None = None,
        max_length: int | torch.Tensor | None = None,
    ):
        self.batch_size, self.seq_len, self.device = batch_size, seq_len, torch.device(device)
        self.bounds = None if cu_seq_lens is None else host_bounds(cu_seq_lens)
        self.layers: dict[str, Any] = {}
        self.ring_halves: RingHalves | None = None
        self.cu_seq_lens = self.max_length = self.attention_segments = None
        if self.bounds is None:
            return
        if torch.is_tensor(max_length):
            max_length = max_length.item()  # a collator that writes it as a tensor costs one read
        with host_side():
            lengths = [end - start for start, end in itertools.pairwise(self.bounds)]
            self.max_length = int(max(lengths) if max_length is None else max_length)
            self.attention_segments = row_segments(self.bounds, batch_size, seq_len)
            self.cu_seq_lens = to_device_async(torch.tensor(self.bounds, dtype=torch.int32), self.device)
        _SEGMENTS[self.cu_seq_lens] = ((batch_size, seq_len, self.cu_seq_lens._version), self.attention_segments)

    def plan_context_parallel(self, layout: Any) -> None:
        """The ring attention's halves of this rank's layout (`CPLayout`), when there is a ring."""
        with host_side():
            self.ring_halves = ring_halves(layout, self.device)

    def decoder_kwargs(self) -> dict[str, Any]:
        """The decoder's keywords: HF's varlen keywords of a packed batch and the plan itself."""
        kwargs: dict[str, Any] = {BATCH_PLAN_KEY: self}
        if self.bounds is not None:
            kwargs.update(
                cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                max_length_q=self.max_length, max_length_k=self.max_length,
            )
        return kwargs
