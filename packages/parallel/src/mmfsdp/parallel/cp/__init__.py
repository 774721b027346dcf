"""Context parallel for the decoder: the zigzag split, Ulysses, Ring and Hybrid attention, the loss sum.

Where it sits in a training forward (the model wires it; see docs/parallelism.md):
vision tower and projector run on every CP rank (over all images, or with
vision data parallel over the rank's share, the features all-gathered), image
features are merged into the embeddings, position ids are computed for the full sequence,
then `split_for_cp` cuts embeddings, position ids, shift labels and loss
weights with one `CPLayout`; every decoder attention calls
`context_parallel_attention`; the per-shard loss sum goes through
`cp_loss_reduce`.
"""

from mmfsdp.parallel.cp.attention import context_parallel_attention, ring_halves
from mmfsdp.parallel.cp.kernels import AttentionKernel, get_ring_kernel, register_ring_kernel
from mmfsdp.parallel.cp.layout import (
    CPLayout,
    gather_from_cp,
    merge_cp_shards,
    required_multiple,
    split_for_cp,
    to_device_async,
    zigzag_chunks,
)
from mmfsdp.parallel.cp.loss import cp_loss_reduce
from mmfsdp.parallel.cp.ring import RingHalves, ring_attention
from mmfsdp.parallel.cp.ulysses import heads_to_seq, repeat_kv_for_ulysses, seq_to_heads, ulysses_attention
from mmfsdp.parallel.cp.validate import validate_cp_world_size, validate_sequence_multiple, validate_ulysses_heads

__all__ = [
    "AttentionKernel",
    "CPLayout",
    "RingHalves",
    "context_parallel_attention",
    "cp_loss_reduce",
    "gather_from_cp",
    "get_ring_kernel",
    "heads_to_seq",
    "merge_cp_shards",
    "register_ring_kernel",
    "repeat_kv_for_ulysses",
    "required_multiple",
    "ring_attention",
    "ring_halves",
    "seq_to_heads",
    "split_for_cp",
    "to_device_async",
    "ulysses_attention",
    "validate_cp_world_size",
    "validate_sequence_multiple",
    "validate_ulysses_heads",
    "zigzag_chunks",
]
