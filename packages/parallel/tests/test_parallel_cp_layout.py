"""The zigzag split, its inverse, the local sample boundaries and the config checks (no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmfsdp.config import ConfigError
from mmfsdp.parallel.cp import (
    CPLayout,
    merge_cp_shards,
    required_multiple,
    split_for_cp,
    validate_cp_world_size,
    validate_sequence_multiple,
    validate_ulysses_heads,
    zigzag_chunks,
)


def _all_ranks(layout: CPLayout) -> list[CPLayout]:
    return [layout.for_cp_rank(r) for r in range(layout.cp_size)]


def test_required_multiple():
    assert required_multiple(1, 1) == 1
    assert required_multiple(1, 4) == 4
    assert required_multiple(2, 1) == 4
    assert required_multiple(4, 2) == 16


def test_zigzag_chunks_pair_cheap_and_expensive_chunks():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_ring_split_of_a_plain_sequence():
    layout = CPLayout.create(16, ring_size=2)
    assert [l.token_indices().tolist() for l in _all_ranks(layout)] == [
        [0, 1, 2, 3, 12, 13, 14, 15],
        [4, 5, 6, 7, 8, 9, 10, 11],
    ]
    assert layout.local_cu_seq_lens() is None


def test_ulysses_splits_the_ring_local_sequence_contiguously():
    layout = CPLayout.create(16, ring_size=2, ulysses_size=2)
    assert [l.token_indices().tolist() for l in _all_ranks(layout)] == [
        [0, 1, 2, 3],
        [12, 13, 14, 15],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


def test_packed_samples_are_each_split_into_zigzag_chunks():
    layout = CPLayout.create(12, [0, 4, 12], ring_size=2)
    assert [l.token_indices().tolist() for l in _all_ranks(layout)] == [
        [0, 3, 4, 5, 10, 11],
        [1, 2, 6, 7, 8, 9],
    ]
    assert layout.local_cu_seq_lens() == (0, 2, 6)


def test_ulysses_only_packed_keeps_global_boundaries_for_attention():
    layout = CPLayout.create(12, torch.tensor([0, 4, 12], dtype=torch.int32), ulysses_size=2, ulysses_rank=1)
    assert layout.token_indices().tolist() == [6, 7, 8, 9, 10, 11]
    assert layout.local_cu_seq_lens() == (0, 4, 12)


@settings(max_examples=40, deadline=None)
@given(
    ring=st.sampled_from([1, 2, 4]),
    ulysses=st.sampled_from([1, 2, 3]),
    units=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    packed=st.booleans(),
)
def test_split_partitions_the_sequence_and_merge_inverts_it(ring, ulysses, units, packed):
    multiple = required_multiple(ring, ulysses)
    lengths = [u * multiple for u in units] if packed else [sum(units) * multiple]
    seq_len = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    layout = CPLayout.create(seq_len, cu, ring_size=ring, ulysses_size=ulysses)
    ranks = _all_ranks(layout)
    indices = torch.cat([l.token_indices() for l in ranks])
    assert sorted(indices.tolist()) == list(range(seq_len))
    assert all(l.token_indices().numel() == seq_len // (ring * ulysses) for l in ranks)

    x = torch.arange(2 * seq_len * 3).view(2, seq_len, 3)
    shards = [split_for_cp(x, l, dim=1) for l in ranks]
    assert torch.equal(merge_cp_shards(shards, layout, dim=1), x)

    if packed:
        # every ring rank holds 1/ring of each sample, and those tokens stay in their sample
        sample_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for ring_rank in range(ring):
            ring_local = torch.cat([ranks[ring_rank * ulysses + u].token_indices() for u in range(ulysses)])
            local_cu = layout.for_cp_rank(ring_rank * ulysses).local_cu_seq_lens()
            for i, (start, end) in enumerate(zip(local_cu[:-1], local_cu[1:])):
                assert (sample_of[ring_local[start:end]] == i).all()
                assert end - start == lengths[i] // ring


def test_bad_sample_length_is_a_clear_error():
    with pytest.raises(ValueError, match="sample 1 of the packed batch has 6 tokens; pad each sample to a multiple of 8"):
        CPLayout.create(14, [0, 8, 14], ring_size=2, ulysses_size=2)
    with pytest.raises(ValueError, match="the sequence has 10 tokens"):
        CPLayout.create(10, ring_size=2)
    with pytest.raises(ValueError, match="from 0 to the sequence length 16"):
        CPLayout.create(16, [0, 8], ring_size=2)


def test_split_checks_the_sequence_dimension():
    with pytest.raises(ValueError, match="dimension 0 has 2 tokens, the layout expects 8"):
        split_for_cp(torch.zeros(2, 8), CPLayout.create(8, ring_size=2), dim=0)


def test_ulysses_heads_must_divide():
    validate_ulysses_heads(32, 8, 4)
    validate_ulysses_heads(32, 1, 8)
    with pytest.raises(ConfigError, match=r"^parallel\.ulysses_parallel_size: 3 does not divide 32 attention heads$"):
        validate_ulysses_heads(32, 8, 3)


def test_cp_size_must_divide_world_size():
    validate_cp_world_size(2, 2, 8)
    with pytest.raises(ConfigError, match=r"^parallel\.ring_attention_size: .* = 6 does not divide 8 processes$"):
        validate_cp_world_size(3, 2, 8)


def test_sequence_multiple():
    validate_sequence_multiple(4096, 2, 4, "data.max_length")
    with pytest.raises(ConfigError, match=r"^data\.max_length: 100 is not a positive multiple of 16 \(2 × ring_attention_size 2"):
        validate_sequence_multiple(100, 2, 4, "data.max_length")
    with pytest.raises(ConfigError, match=r"of 4 \(ulysses_parallel_size 4\)"):
        validate_sequence_multiple(6, 1, 4, "data.pad_to_multiple_of")
