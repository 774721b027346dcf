"""Context-parallel checks that need no process group; each raises `ConfigError` with a `parallel.` key.

The app runs them after the config is built and before `init_process_group`,
so a user sees one clear line instead of a hang or a shape error inside an
all-to-all.
"""

from __future__ import annotations

from mmfsdp.config import ConfigError
from mmfsdp.parallel.cp.layout import required_multiple

__all__ = ["validate_cp_world_size", "validate_sequence_multiple", "validate_ulysses_heads"]


def validate_ulysses_heads(num_attention_heads: int, num_key_value_heads: int, ulysses_size: int) -> None:
    """Ulysses shards attention heads, so its size must divide the number of query heads.

    Any number of key/value heads works (they are repeated as needed, see `ulysses.py`).
    """
    if num_attention_heads % ulysses_size:
        raise ConfigError(
            "parallel.ulysses_parallel_size",
            f"{ulysses_size} does not divide {num_attention_heads} attention heads",
        )
    assert num_key_value_heads > 0 and num_attention_heads % num_key_value_heads == 0, (
        num_attention_heads, num_key_value_heads,
    )


def validate_cp_world_size(ring_size: int, ulysses_size: int, world_size: int) -> None:
    """The context-parallel group (ring × Ulysses ranks) must tile the world."""
    cp_size = ring_size * ulysses_size
    if world_size % cp_size:
        raise ConfigError(
            "parallel.ring_attention_size",
            f"ring_attention_size {ring_size} × ulysses_parallel_size {ulysses_size} = {cp_size} "
            f"does not divide {world_size} processes",
        )


def validate_sequence_multiple(value: int, ring_size: int, ulysses_size: int, key: str) -> None:
    """A sequence length or padding multiple (named by `key`) must be a multiple of what CP splits by."""
    multiple = required_multiple(ring_size, ulysses_size)
    if value <= 0 or value % multiple:
        how = f"ulysses_parallel_size {ulysses_size}"
        if ring_size > 1:
            how = f"2 × ring_attention_size {ring_size} × {how}"
        raise ConfigError(key, f"{value} is not a positive multiple of {multiple} ({how}), which context parallel needs")
