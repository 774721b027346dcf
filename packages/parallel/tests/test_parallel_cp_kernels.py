"""The CPU ring kernel (forward with lse, backward given out and lse) against autograd SDPA, one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmfsdp.parallel.cp import AttentionKernel, CPLayout, context_parallel_attention, get_ring_kernel, register_ring_kernel
from mmfsdp.parallel.testing import assert_within

TOLERANCE = 1e-5


def _relative(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def _reference(q, k, v, lengths_q, lengths_k, causal, scale):
    """Per-sample SDPA with autograd (and the sample's log-sum-exp), concatenated over samples."""
    outs, lses = [], []
    groups = q.size(2) // k.size(2)
    for (qs, ql), (ks, kl) in zip(lengths_q, lengths_k):
        qi = q[:, qs : qs + ql].transpose(1, 2)
        ki = k[:, ks : ks + kl].repeat_interleave(groups, 2).transpose(1, 2)
        vi = v[:, ks : ks + kl].repeat_interleave(groups, 2).transpose(1, 2)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale).transpose(1, 2))
        scores = qi @ ki.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(ql, kl, dtype=torch.bool).triu(1), float("-inf"))
        lses.append(scores.logsumexp(-1))
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _segments(cu):
    return [(s, e - s) for s, e in zip(cu[:-1], cu[1:])]


@pytest.mark.parametrize(
    "batch, cu_q, cu_k, heads, kv_heads, causal",
    [
        (2, None, None, 4, 4, True),
        (2, None, None, 4, 2, False),
        (1, (0, 6, 10, 18), (0, 6, 10, 18), 4, 1, True),
        (1, (0, 6, 10, 18), (0, 3, 5, 9), 2, 2, False),
    ],
)
def test_cpu_kernel_matches_sdpa(batch, cu_q, cu_k, heads, kv_heads, causal):
    torch.manual_seed(0)
    S, T, D = (cu_q[-1], cu_k[-1], 8) if cu_q else (12, 12 if causal else 7, 8)
    scale = D**-0.5
    q = torch.randn(batch, S, heads, D, requires_grad=True)
    k = torch.randn(batch, T, kv_heads, D, requires_grad=True)
    v = torch.randn(batch, T, kv_heads, D, requires_grad=True)
    dout = torch.randn(batch, S, heads, D)
    expected, expected_lse = _reference(q, k, v, _segments(cu_q or (0, S)), _segments(cu_k or (0, T)), causal, scale)
    expected.backward(dout)

    kernel = get_ring_kernel("cpu")
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), causal=causal, scale=scale, cu_q=cu_q, cu_k=cu_k)
    dq, dk, dv = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=causal, scale=scale, cu_q=cu_q, cu_k=cu_k)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, S)
    assert_within(_relative(out, expected.detach()), TOLERANCE, "output")
    assert_within(_relative(lse, expected_lse.detach()), TOLERANCE, "log-sum-exp")
    assert_within(_relative(dq, q.grad), TOLERANCE, "dq")
    assert_within(_relative(dk, k.grad), TOLERANCE, "dk")
    assert_within(_relative(dv, v.grad), TOLERANCE, "dv")


def test_without_context_parallel_the_entry_point_is_plain_attention():
    torch.manual_seed(0)
    q = torch.randn(1, 12, 2, 8, requires_grad=True)
    k = torch.randn(1, 12, 1, 8, requires_grad=True)
    v = torch.randn(1, 12, 1, 8, requires_grad=True)
    layout = CPLayout.create(12, [0, 5, 12])
    out = context_parallel_attention(q, k, v, layout)
    expected, _ = _reference(q, k, v, [(0, 5), (5, 7)], [(0, 5), (5, 7)], True, 8**-0.5)
    assert_within(_relative(out, expected), TOLERANCE, "output")


def test_a_registered_kernel_replaces_the_default():
    default = get_ring_kernel("cpu")
    calls = []

    def forward(*args, **kwargs):
        calls.append(kwargs["cu_q"])
        return default.forward(*args, **kwargs)

    register_ring_kernel("cpu", AttentionKernel("counting", forward, default.backward))
    try:
        q = torch.randn(1, 8, 2, 4)
        context_parallel_attention(q, q, q, CPLayout.create(8))
    finally:
        register_ring_kernel("cpu", default)
    assert calls == [None]
    with pytest.raises(NotImplementedError, match="no ring-attention kernel for device type 'meta'"):
        get_ring_kernel("meta")
