"""Ulysses, Ring and Hybrid attention on 2 and 4 gloo ranks equal single-process attention.

Every rank builds the same full q/k/v (fixed seed), computes the reference with
`scaled_dot_product_attention` over the whole sequence (block-diagonal causal
mask for packed batches), runs context-parallel attention on its shard, and
compares its output shard and its q/k/v gradient shards with the reference's
(relative Frobenius error, fp32). One spawn per world size runs all cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmfsdp.parallel.cp import CPLayout, context_parallel_attention, gather_from_cp, split_for_cp
from mmfsdp.parallel.testing import assert_within, run_distributed

TOLERANCE = 1e-5

# name: (ring, ulysses, batch, lengths (one entry: dense rows), heads, kv_heads, causal)
CASES_2 = {
    "ring2-dense": (2, 1, 2, [16], 4, 4, True),
    "ring2-gqa2": (2, 1, 1, [24], 4, 2, True),
    "ring2-gqa1": (2, 1, 2, [8], 4, 1, True),
    "ring2-packed": (2, 1, 1, [8, 24, 4, 12], 4, 2, True),
    "ring2-packed-noncausal": (2, 1, 1, [8, 16, 4], 2, 1, False),
    "ulysses2-gqa1": (1, 2, 2, [14], 4, 1, True),
    "ulysses2-gqa3": (1, 2, 1, [10], 6, 3, True),
    "ulysses2-packed": (1, 2, 1, [6, 2, 14, 8], 4, 2, True),
}
CASES_4 = {
    "ring4-gqa2": (4, 1, 1, [32], 4, 2, True),
    "ring4-packed": (4, 1, 1, [16, 8, 40], 4, 1, True),
    "ulysses4-gqa1": (1, 4, 2, [12], 4, 1, True),
    "ulysses4-packed": (1, 4, 1, [4, 12, 8], 4, 2, True),
    "hybrid2x2-dense": (2, 2, 2, [16], 4, 1, True),
    "hybrid2x2-packed": (2, 2, 1, [8, 24, 16], 4, 2, True),
    "hybrid2x2-packed-noncausal": (2, 2, 1, [16, 8], 2, 2, False),
}


def _reference_mask(lengths: list[int], causal: bool) -> torch.Tensor:
    total = sum(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = sample[:, None] == sample[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    return mask


def _reference(q, k, v, lengths, causal):
    groups = q.size(2) // k.size(2)
    mask = _reference_mask(lengths, causal)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(groups, 2).transpose(1, 2),
        v.repeat_interleave(groups, 2).transpose(1, 2),
        attn_mask=mask,
    )
    return out.transpose(1, 2)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


_GROUPS: dict[tuple[int, int], tuple] = {}


def _make_groups(world_size: int, ring: int, ulysses: int):
    """Ring and Ulysses groups for a CP group spanning the world (CP rank = ring_rank · U + ulysses_rank)."""
    if (ring, ulysses) not in _GROUPS:
        _GROUPS[ring, ulysses] = _new_groups(world_size, ring, ulysses)
    return _GROUPS[ring, ulysses]


def _new_groups(world_size: int, ring: int, ulysses: int):
    rank = dist.get_rank()
    ring_group = ulysses_group = None
    for r in range(ring):
        ranks = list(range(r * ulysses, (r + 1) * ulysses))
        group = dist.new_group(ranks)
        if rank in ranks:
            ulysses_group = group
    for u in range(ulysses):
        ranks = list(range(u, world_size, ulysses))
        group = dist.new_group(ranks)
        if rank in ranks:
            ring_group = group
    return ring_group, ulysses_group


def _run_case(rank, world_size, case, case_index):
    ring, ulysses, batch, lengths, heads, kv_heads, causal = case
    assert ring * ulysses == world_size
    ring_group, ulysses_group = _make_groups(world_size, ring, ulysses)
    packed = len(lengths) > 1
    seq_len = sum(lengths)
    cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if packed else None
    generator = torch.Generator().manual_seed(1234 + case_index)
    dim = 8
    q = torch.randn(batch, seq_len, heads, dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, requires_grad=True)
    grad_out = torch.randn(batch, seq_len, heads, dim, generator=generator)

    expected = _reference(q, k, v, lengths, causal)
    expected.backward(grad_out)

    ring_rank, ulysses_rank = divmod(rank, ulysses)
    layout = CPLayout.create(
        seq_len, cu_seq_lens, ring_size=ring, ring_rank=ring_rank, ulysses_size=ulysses, ulysses_rank=ulysses_rank
    )
    q_local, k_local, v_local = (split_for_cp(t.detach(), layout).requires_grad_() for t in (q, k, v))
    out_local = context_parallel_attention(
        q_local, k_local, v_local, layout, ring_group=ring_group, ulysses_group=ulysses_group, causal=causal
    )
    out_local.backward(split_for_cp(grad_out, layout))

    errors = {
        "out": _relative(out_local.detach(), split_for_cp(expected.detach(), layout)),
        "dq": _relative(q_local.grad, split_for_cp(q.grad, layout)),
        "dk": _relative(k_local.grad, split_for_cp(k.grad, layout)),
        "dv": _relative(v_local.grad, split_for_cp(v.grad, layout)),
        "gathered_out": _relative(gather_from_cp(out_local.detach(), layout, dist.group.WORLD), expected.detach()),
    }
    return errors


def _run_cases(rank, world_size, cases):
    return {name: _run_case(rank, world_size, case, i) for i, (name, case) in enumerate(cases.items())}


@pytest.fixture(scope="module")
def errors_2():
    return run_distributed(_run_cases, 2, CASES_2, timeout=240)


@pytest.fixture(scope="module")
def errors_4():
    return run_distributed(_run_cases, 4, CASES_4, timeout=240)


def _check(per_rank: list[dict], name: str) -> None:
    for rank, errors in enumerate(per_rank):
        for what, error in errors[name].items():
            assert_within(error, TOLERANCE, f"{name} rank {rank} {what}")


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks_match_single_process_attention(errors_2, name):
    _check(errors_2, name)


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks_match_single_process_attention(errors_4, name):
    _check(errors_4, name)
