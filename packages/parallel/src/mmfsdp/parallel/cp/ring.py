"""Load-balanced causal ring attention with a ring backward.

Each ring rank holds the ring-local sequence of `layout.py`: for every sample,
chunks r and 2R−1−r of its 2R chunks — the *front* and *back* half of the
sample's local tokens. Queries stay put; K/V travel around the ring.

Forward, step i = 0..R−1 (rank r holds the K/V of rank j = (r − i) mod R):
- i = 0: local block, causal within each sample (front precedes back).
- j < r: every local query sees the remote *front* halves entirely and none of
  the remote back halves (their chunk 2R−1−j lies after both local chunks).
- j > r: only the local *back* halves see anything, and they see all of the
  remote tokens.
Every non-diagonal step is one full rectangular block of half the local
queries × half the keys, so the ring is balanced. Each block's (out, lse) is
merged into the running result: lse' = logaddexp(lse, lse_b),
out' = out·e^(lse−lse') + out_b·e^(lse_b−lse'). While a step computes, the next
K/V is already in flight (`batch_isend_irecv` to rank r+1, from rank r−1).

Backward runs the same ring again. Each block's gradients come from the local
kernel's backward given the merged out and lse. dQ accumulates locally; the
dK/dV of the block a rank holds is added to an accumulator that travels with
the K/V, so after R hops every rank receives the full dK/dV of its own K/V.
Only q, k, v, out and lse are saved for backward — the memory of one local block.

Packed batches: `cu_seq_lens` are the ring-local sample boundaries
(`CPLayout.local_cu_seq_lens()`); every block is block-diagonal over the
samples, so no token attends across samples. Without a causal mask every step
is a full block.

Shape legend: B batch, S local tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmfsdp.parallel.cp.kernels import AttentionKernel, get_ring_kernel, prepare_kernel_bounds
from mmfsdp.parallel.cp.layout import to_device_async

__all__ = ["RingHalves", "ring_attention"]


class RingHalves:
    """Front/back half token indices (on the device) and boundaries of a ring-local sequence: what every ring
    attention call of one micro-batch reads. Made on the host once per micro-batch (the training forward's batch
    plan) and moved to the device from pinned memory without waiting; a call given none makes its own."""

    __slots__ = ("seq_len", "cu_seq_lens", "front", "back", "cu_half")

    def __init__(self, seq_len: int, cu_seq_lens: tuple[int, ...] | None, device: torch.device):
        bounds = cu_seq_lens or (0, seq_len)
        front, back, half_bounds = [], [], [0]
        for start, end in zip(bounds[:-1], bounds[1:]):
            half = (end - start) // 2
            assert 2 * half == end - start, f"ring-local sample length {end - start} is odd"
            front.append(torch.arange(start, start + half))
            back.append(torch.arange(start + half, end))
            half_bounds.append(half_bounds[-1] + half)
        self.seq_len, self.cu_seq_lens = seq_len, cu_seq_lens
        self.front = to_device_async(torch.cat(front), device)
        self.back = to_device_async(torch.cat(back), device)
        self.cu_half = tuple(half_bounds) if cu_seq_lens is not None else None
        if cu_seq_lens is not None:
            prepare_kernel_bounds((cu_seq_lens, self.cu_half), device)


class _Exchange:
    """Sends `send` to the next ring rank and receives the previous rank's tensor of the same shape.

    Holds the send buffer until `wait()`, so it cannot be freed while in flight.
    """

    def __init__(self, send: torch.Tensor, group: dist.ProcessGroup):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self._send, self._recv = send, torch.empty_like(send)
        self._requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
                dist.P2POp(dist.irecv, self._recv, dist.get_global_rank(group, (rank - 1) % size), group),
            ]
        )

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._send = None
        return self._recv


def _merge(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, block_out_BSHD: torch.Tensor, block_lse_BHS: torch.Tensor):
    new_lse = torch.logaddexp(lse_BHS, block_lse_BHS)
    keep = (lse_BHS - new_lse).exp().transpose(1, 2).unsqueeze(-1)
    take = (block_lse_BHS - new_lse).exp().transpose(1, 2).unsqueeze(-1)
    return out_BSHD * keep + block_out_BSHD.float() * take, new_lse


def _ring_position(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BSHD, k_BSKD, v_BSKD, group, kernel: AttentionKernel, causal: bool, scale: float, cu_seq_lens,
                halves: RingHalves | None):
        rank, size = _ring_position(group)
        if not (causal and size > 1):
            halves = None
        elif halves is None:
            halves = RingHalves(q_BSHD.size(1), cu_seq_lens, q_BSHD.device)
        full = dict(scale=scale, cu_q=cu_seq_lens, cu_k=cu_seq_lens)
        kv = torch.stack([k_BSKD, v_BSKD])
        out = lse = None
        for step in range(size):
            exchange = _Exchange(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            k, v = kv[0], kv[1]
            if step == 0:
                out, lse = kernel.forward(q_BSHD, k, v, causal=causal, **full)
                out = out.float()
            elif not causal:
                out, lse = _merge(out, lse, *kernel.forward(q_BSHD, k, v, causal=False, **full))
            elif source < rank:
                block = kernel.forward(
                    q_BSHD, k.index_select(1, halves.front), v.index_select(1, halves.front),
                    causal=False, scale=scale, cu_q=cu_seq_lens, cu_k=halves.cu_half,
                )
                out, lse = _merge(out, lse, *block)
            else:
                block = kernel.forward(
                    q_BSHD.index_select(1, halves.back), k, v,
                    causal=False, scale=scale, cu_q=halves.cu_half, cu_k=cu_seq_lens,
                )
                back_out, back_lse = _merge(out.index_select(1, halves.back), lse.index_select(2, halves.back), *block)
                out.index_copy_(1, halves.back, back_out)
                lse.index_copy_(2, halves.back, back_lse)
            if exchange is not None:
                kv = exchange.wait()
        out = out.to(q_BSHD.dtype)
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out, lse)
        ctx.group, ctx.kernel, ctx.causal, ctx.scale, ctx.cu_seq_lens, ctx.halves = group, kernel, causal, scale, cu_seq_lens, halves
        return out

    @staticmethod
    def backward(ctx, dout_BSHD):
        q, k_own, v_own, out, lse = ctx.saved_tensors
        group, kernel, causal, scale, cu_seq_lens, halves = ctx.group, ctx.kernel, ctx.causal, ctx.scale, ctx.cu_seq_lens, ctx.halves
        rank, size = _ring_position(group)
        dout = dout_BSHD.contiguous()
        full = dict(scale=scale, cu_q=cu_seq_lens, cu_k=cu_seq_lens)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k_own, v_own])
        dkv_exchange = None
        for step in range(size):
            kv_exchange = _Exchange(kv, group) if step + 1 < size else None
            source = (rank - step) % size
            k, v = kv[0], kv[1]
            if step == 0 or not causal:
                dq_b, dk_b, dv_b = kernel.backward(dout, q, k, v, out, lse, causal=causal and step == 0, **full)
                dq += dq_b
                dkv = torch.stack([dk_b, dv_b]).float()
            elif source < rank:
                dq_b, dk_b, dv_b = kernel.backward(
                    dout, q, k.index_select(1, halves.front), v.index_select(1, halves.front), out, lse,
                    causal=False, scale=scale, cu_q=cu_seq_lens, cu_k=halves.cu_half,
                )
                dq += dq_b
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                dkv.index_add_(2, halves.front, torch.stack([dk_b, dv_b]).float())
            else:
                dq_b, dk_b, dv_b = kernel.backward(
                    dout.index_select(1, halves.back), q.index_select(1, halves.back), k, v,
                    out.index_select(1, halves.back), lse.index_select(2, halves.back).contiguous(),
                    causal=False, scale=scale, cu_q=halves.cu_half, cu_k=cu_seq_lens,
                )
                dq.index_add_(1, halves.back, dq_b.float())
                dkv = torch.stack([dk_b, dv_b]).float()
            if dkv_exchange is not None:
                dkv += dkv_exchange.wait()
            if size > 1:
                # the dK/dV accumulator of the K/V held now travels with it; after the last step it reaches its owner
                dkv_exchange = _Exchange(dkv, group)
            if kv_exchange is not None:
                kv = kv_exchange.wait()
        if dkv_exchange is not None:
            dkv = dkv_exchange.wait()
        return dq.to(q.dtype), dkv[0].to(k_own.dtype), dkv[1].to(v_own.dtype), None, None, None, None, None, None


def ring_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    cu_seq_lens: tuple[int, ...] | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    halves: RingHalves | None = None,
) -> torch.Tensor:
    """Attention of the ring-local q over the whole ring's k/v; returns the local output.

    `group` is the ring process group (`None` or size 1: plain local attention).
    `cu_seq_lens` are the ring-local sample boundaries of a packed batch (B = 1).
    `halves`: the `RingHalves` of this sequence and `cu_seq_lens`, made once per micro-batch (None: made here).
    """
    B, S, H, D = q_BSHD.shape
    assert k_BSKD.shape == v_BSKD.shape and k_BSKD.shape[:2] == (B, S) and H % k_BSKD.size(2) == 0, (
        q_BSHD.shape, k_BSKD.shape, v_BSKD.shape,
    )
    assert cu_seq_lens is None or (B == 1 and cu_seq_lens[-1] == S), (B, S, cu_seq_lens)
    kernel = kernel or get_ring_kernel(q_BSHD.device.type)
    assert halves is None or (halves.seq_len == S and halves.cu_seq_lens == cu_seq_lens), "halves of another sequence"
    scale = D**-0.5 if scale is None else scale
    return _RingAttention.apply(q_BSHD, k_BSKD, v_BSKD, group, kernel, causal, scale, cu_seq_lens, halves)
