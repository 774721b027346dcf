"""The packed chunked gated delta rule and the packed causal convolution: the Gated DeltaNet's kernels over
samples laid end to end (`cu_seq_lens`), each sample's state starting from zero (or its given initial state).

`chunk_gated_delta_rule_packed` runs the delta rule of every sample of one packed row in chunks of `CHUNK` tokens
(the WY transform of HF / fla over segments with a per-segment initial state and final state), from a
`SegmentPlan` made once per micro-batch on the host; its backward recomputes the scan group by group from the states
entering the groups (`_ChunkScan`), so between forward and backward it holds its inputs, those states and the UT
systems' inverses, not the other intra-chunk matrices; `resolve_gdn_kernel` says which implementation runs
(`model.gdn_kernel`: this torch operator, or fla's Triton kernel on CUDA); `packed_causal_conv1d` is the causal
convolution that sees no input of the previous sample. The layer that uses them, its context-parallel paths and
its micro-batch plan are `mmfsdp.model.gated_deltanet`.

Shape legend: T tokens, Hk key heads, Hv value heads, dk/dv head dims, C conv channels, K conv kernel,
N samples/segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from transformers.activations import ACT2FN

__all__ = [
    "CHUNK",
    "GDN_KERNELS",
    "SegmentPlan",
    "chunk_gated_delta_rule_packed",
    "packed_causal_conv1d",
    "resolve_gdn_kernel",
]

CHUNK = 64
_L2_EPS = 1e-6
_RECOMPUTE_CHUNKS = 8
"""Chunks per group of scan steps that `_ChunkScan`'s backward recomputes at once (the state entering each group is
saved): more saves fewer states and keeps a larger graph alive in the backward."""
GDN_KERNELS = ("auto", "torch", "fla")
"""The chunked delta rule's implementations: "torch" (this module), "fla" (fla's Triton kernel, CUDA), "auto" (fla
where it can run, else torch)."""

def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means: no fla kernel
        return None
    return chunk_gated_delta_rule


# ---------------------------------------------------------------------------------------------------------------
# convolution


def _conv_indices(seg_starts: Sequence[int], seg_lens: Sequence[int], K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host index tensors of `packed_causal_conv1d`: the rows of `[tokens; halos]` in extended order (each segment's
    halo, then its tokens) and, of the convolution's outputs, those of the tokens."""
    T, n_seg = int(sum(seg_lens)), len(seg_starts)
    starts = torch.tensor(list(seg_starts), dtype=torch.long)
    lens = torch.tensor(list(seg_lens), dtype=torch.long)
    ext_lens = lens + K - 1
    seg_of_ext = torch.repeat_interleave(torch.arange(n_seg), ext_lens, output_size=T + n_seg * (K - 1))
    ext_starts = torch.cumsum(ext_lens, 0) - ext_lens
    pos = torch.arange(seg_of_ext.numel()) - ext_starts[seg_of_ext] - (K - 1)  # < 0: halo row
    is_tok = pos >= 0
    index = torch.where(is_tok, starts[seg_of_ext] + pos, T + seg_of_ext * (K - 1) + pos + (K - 1))
    # output j covers ext rows j .. j+K-1, i.e. the token at ext row j+K-1
    keep = torch.arange(seg_of_ext.numel())[is_tok] - (K - 1)
    return index, keep


def packed_causal_conv1d(
    x_TC: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    activation: str | None,
    seg_starts: Sequence[int],
    seg_lens: Sequence[int],
    halo_NKC: torch.Tensor | None = None,
    *,
    plan: SegmentPlan | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of `x_TC` over contiguous segments covering `[0, T)`.

    Segment n sees, before its first token, `halo_NKC[n]` (`K − 1` inputs, oldest first;
    zeros when None), never the tokens of the segment before it. Returns `[T, C]`.
    `plan`: the segments' index tensors on `x_TC`'s device (`SegmentPlan`); without one they are built here.
    """
    C = x_TC.size(1)
    K = weight_CK.size(-1)
    if plan is None:
        plan = SegmentPlan(seg_starts, seg_lens, K, x_TC.device)
    assert plan.conv_kernel == K and plan.lens == tuple(seg_lens), "the plan is of other segments"
    if halo_NKC is None:
        halo_NKC = x_TC.new_zeros(len(seg_starts), K - 1, C)
    # source rows: the tokens, then the halos; ext = for each segment, its halo then its tokens
    src = torch.cat([x_TC, halo_NKC.reshape(-1, C).to(x_TC.dtype)])
    ext = src.index_select(0, plan.conv_index)  # [E, C]
    out = F.conv1d(ext.t().unsqueeze(0).to(weight_CK.dtype), weight_CK.unsqueeze(1), bias_C, groups=C)[0]
    out = out.index_select(1, plan.conv_keep).t().contiguous()
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x_TC.dtype)


# ---------------------------------------------------------------------------------------------------------------
# chunked gated delta rule


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower inputs (as HF and fla), fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


class _ToSlots(torch.autograd.Function):
    """Rows `[T, ...]` → slots `[n_slots, ...]`: row t to slot `inverse[t]` (distinct slots), zeros elsewhere. One
    allocation and a scatter; the backward is the gather `_FromSlots` (no padded copy of the rows either way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, inverse: torch.Tensor, n_slots: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.new_zeros(n_slots, *x.shape[1:]).index_copy_(0, inverse, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _FromSlots.apply(grad, inverse), None, None


class _FromSlots(torch.autograd.Function):
    """Slots → rows: `x[inverse]`; the backward scatters back into zeroed slots (`_ToSlots`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.n_slots = x.size(0)
        return x.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _ToSlots.apply(grad, inverse, ctx.n_slots), None


def _chunk_plan(seg_lens: Sequence[int], chunk: int):
    """Step-major order of all chunks: step j holds chunk j of the segments with more than j chunks (longest first)."""
    n_chunks = [max(1, math.ceil(n / chunk)) for n in seg_lens]
    order = sorted(range(len(seg_lens)), key=lambda s: (-n_chunks[s], s))
    counts = [sum(1 for n in n_chunks if n > j) for j in range(max(n_chunks, default=0))]
    chunk_seg = [order[i] for j, n in enumerate(counts) for i in range(n)]
    chunk_j = [j for j, n in enumerate(counts) for _ in range(n)]
    return order, counts, chunk_seg, chunk_j


def _chunk_indices(seg_starts: Sequence[int], seg_lens: Sequence[int], chunk: int) -> dict[str, Any]:
    """Host side of `chunk_gated_delta_rule_packed`'s regrouping: the (chunk, position) slot of every token, the
    scan order of the segments, the segments per scan step, and where each segment's final state lands in the
    scan's output."""
    T, n_seg = int(sum(seg_lens)), len(seg_starts)
    order, counts, chunk_seg, chunk_j = _chunk_plan(seg_lens, chunk)
    cs = torch.tensor(chunk_seg, dtype=torch.long)
    cj = torch.tensor(chunk_j, dtype=torch.long)
    starts = torch.tensor(list(seg_starts), dtype=torch.long)
    lens = torch.tensor(list(seg_lens), dtype=torch.long)
    within = cj[:, None] * chunk + torch.arange(chunk)[None, :]
    valid = within < lens[cs][:, None]
    index = torch.where(valid, starts[cs][:, None] + within, T).reshape(-1)
    slot = torch.arange(valid.numel())[valid.reshape(-1)]
    inverse = torch.empty(T, dtype=torch.long)
    inverse[index[slot]] = slot
    # the scan's step j ends the segments order[n_{j+1}:n_j]
    seg_of_final = [s for j, n in enumerate(counts) for s in order[(counts[j + 1] if j + 1 < len(counts) else 0) : n]]
    where = torch.empty(n_seg, dtype=torch.long)
    where[torch.tensor(seg_of_final, dtype=torch.long)] = torch.arange(n_seg)
    return dict(
        counts=counts,
        n_chunks=len(chunk_seg),
        chunk_inverse=inverse,
        order=torch.tensor(order, dtype=torch.long),
        final_where=where,
    )


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: from pinned memory, without waiting for the copy, on an accelerator."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class SegmentPlan:
    """Every index tensor the Gated DeltaNet needs for the segments of one flattened sequence, made on the host from
    their host bounds and moved to `device` once (pinned, non-blocking): the convolution's regrouping (`conv_index`,
    `conv_keep`), the chunked rule's (`chunk_inverse`, `order`, `final_where`; the segments per scan
    step, `counts`, stay on the host) and fla's `cu_seqlens` (int64). The layers of a micro-batch share one (built
    by `mmfsdp.model.batch_plan` before the forward); a call without one builds its own."""

    def __init__(
        self, seg_starts: Sequence[int], seg_lens: Sequence[int], conv_kernel: int, device: torch.device,
        *, chunk: int = CHUNK,
    ):
        self.starts, self.lens = tuple(int(x) for x in seg_starts), tuple(int(x) for x in seg_lens)
        self.conv_kernel, self.chunk = conv_kernel, chunk
        host = _chunk_indices(self.starts, self.lens, chunk)
        self.counts: list[int] = host.pop("counts")
        self.n_chunks: int = host.pop("n_chunks")
        host["conv_index"], host["conv_keep"] = _conv_indices(self.starts, self.lens, conv_kernel)
        host["cu_seqlens"] = torch.tensor([*self.starts, self.starts[-1] + self.lens[-1]], dtype=torch.long)
        for name, tensor in host.items():
            setattr(self, name, upload(tensor, device))


def _step_groups(counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """The scan steps cut into consecutive groups `[first, stop)` of at least `budget` chunks each (the last may have
    fewer): the units `_ChunkScan` recomputes in its backward, one at a time."""
    groups, first, chunks = [], 0, 0
    for j, n in enumerate(counts):
        chunks += n
        if chunks >= budget or j + 1 == len(counts):
            groups.append((first, j + 1))
            first, chunks = j + 1, 0
    return groups


class _UnitLowerInverse(torch.autograd.Function):
    """The inverses of the unit lower triangular matrices whose strictly lower triangles are `system`'s (`[..., c, c]`;
    the diagonal and the upper triangle are not read), or `inverse` where given (`_ChunkScan.backward` reuses the
    forward's). The triangular solve runs in fp64 and its result is rounded to `system`'s dtype: from an fp32 solve
    the gradients of `g` were 1.5x noisier against an fp64 kernel (A_log 7.0e-6) than with u and w solved for
    directly; rounded from fp64 they are as accurate (4.5e-6), and the solve (against the identity, `c` columns) is
    still cheaper than two solves against `dv` and `dk` columns. The backward is two products,
    `-(Xᵀ dX Xᵀ)` on the strictly lower triangle (X the inverse)."""

    @staticmethod
    def forward(ctx, system: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
        if inverse is None:
            # fp64 where the device has fp64 linear algebra (CPU, CUDA); the compute dtype elsewhere (e.g. NPU)
            solve_dtype = torch.float64 if system.device.type in ("cpu", "cuda") else system.dtype
            eye = torch.eye(system.size(-1), dtype=solve_dtype, device=system.device).expand_as(system)
            inverse = torch.linalg.solve_triangular(system.to(solve_dtype), eye, upper=False, unitriangular=True)
            inverse = inverse.to(system.dtype)
        ctx.save_for_backward(inverse)
        return inverse.view_as(inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        inverse_t = inverse.transpose(-1, -2)
        return -(inverse_t @ grad @ inverse_t).tril(-1), None


def _intra_chunk(q, k, v, g, beta, rep: int, use_qk_l2norm: bool, inverse=None):
    """The intra-chunk quantities of the chunks `q/k`: `[n, Hk, c, dk]`, `v`: `[n, Hv, c, dv]`, `g`, `beta`:
    `[n, Hv, c]` (in the input dtype), in the compute dtype: the UT transform's `u`, `w`, the decayed queries and keys
    `q_dec`, `k_dec`, the intra-chunk attention `[n, Hv, c, c]`, the chunks' decays `[n, Hv, 1, 1]` and the inverse of
    the UT system (`inverse`: that of an earlier call on the same chunks, reused)."""
    dtype = _compute_dtype(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if rep > 1:  # value head h reads key head h // rep, expanded per chunk rather than over the whole row
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q * q.size(-1) ** -0.5
    chunk = q.size(2)
    cum = g.cumsum(-1)  # [n, H, c]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [n, H, c, c]
    k_beta = k * beta.unsqueeze(-1)
    inverse = _UnitLowerInverse.apply((k_beta @ k.transpose(-1, -2)) * decay, inverse)
    u = inverse @ (v * beta.unsqueeze(-1))
    w = inverse @ (k_beta * cum.exp().unsqueeze(-1))
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return u, w, q_dec, intra, k_dec, chunk_decay, inverse


def _scan_steps(u, w, q_dec, intra, k_dec, chunk_decay, state, counts: Sequence[int], n_next: int):
    """Consecutive scan steps of the chunked rule over the intra-chunk quantities of their chunks (`_intra_chunk`,
    step-major): step j takes chunk j of the `counts[j]` segments still running, `state` `[counts[0], Hv, dk, dv]`
    enters the first. Returns the outputs `[rows, Hv, c, dv]`, the final states of the segments that end in these
    steps (scan order) and the state entering the step after them (its first `n_next` segments)."""
    outs, finals = [], []
    # one split per operand (its backward is one concatenation), not a slice per step: a slice's backward writes a
    # zero tensor the size of the whole operand, which made the scan's backward quadratic in the chunk count
    operands = (x.split(list(counts)) for x in (u, w, q_dec, intra, k_dec, chunk_decay))
    for n, n_after, u_j, w_j, q_dec_j, intra_j, k_dec_j, decay_j in zip(counts, [*counts[1:], n_next], *operands):
        state = state[:n]
        v_new = u_j - w_j @ state
        outs.append(q_dec_j @ state + intra_j @ v_new)
        state = state * decay_j + k_dec_j.transpose(-1, -2) @ v_new
        finals.append(state[n_after:])
    return torch.cat(outs), torch.cat(finals), state[:n_next]


class _ChunkScan(torch.autograd.Function):
    """The chunked rule over all scan steps, saving only its inputs (the chunk grids, in the input dtype, key heads
    not yet repeated), the state entering each group of steps (`_step_groups`) and the inverse of every chunk's UT
    system (`[chunks, Hv, c, c]`, the costliest part to recompute on the CPU).

    Autograd over the scan would keep every intra-chunk matrix (`[chunks, H, c, c]`: decays, the UT system, the
    intra-chunk attention), `u`, `w`, the decayed q/k, the normalised and head-repeated q/k and the state every step
    reads, all in fp32, until the backward: about ten times the inputs. The backward instead runs the groups last to
    first, each recomputed from its entering state under autograd (with the saved inverses) and differentiated at
    once, so one group's graph is alive at a time: a second forward without the solve for a fraction of the memory
    (the same operations, so the same numbers)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, counts, groups, rep, use_qk_l2norm):
        out = v.new_empty(v.shape[:-1] + (state.size(-1),), dtype=state.dtype)
        finals, entering, inverses = [], [], []
        row = 0
        for first, stop in groups:
            rows = slice(row, row + sum(counts[first:stop]))
            n_next = counts[stop] if stop < len(counts) else 0
            entering.append(state)
            *intra_chunk, inverse = _intra_chunk(*(x[rows] for x in (q, k, v, g, beta)), rep, use_qk_l2norm)
            out[rows], final, state = _scan_steps(*intra_chunk, state, counts[first:stop], n_next)
            finals.append(final)
            inverses.append(inverse)
            row = rows.stop
        ctx.save_for_backward(q, k, v, g, beta, *entering, *inverses)
        ctx.counts, ctx.groups, ctx.rep, ctx.use_qk_l2norm = counts, groups, rep, use_qk_l2norm
        return out, torch.cat(finals)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_finals):
        q, k, v, g, beta, *saved = ctx.saved_tensors
        counts, groups = ctx.counts, ctx.groups
        entering, inverses = saved[: len(groups)], saved[len(groups) :]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[:5]) if need]
        grads = [torch.empty_like(x) if i in wanted else None for i, x in enumerate((q, k, v, g, beta))]
        row_stop, final_stop = q.size(0), grad_finals.size(0)
        grad_state = None
        for (first, stop), state, inverse in zip(reversed(groups), reversed(entering), reversed(inverses)):
            rows = slice(row_stop - sum(counts[first:stop]), row_stop)
            n_next = counts[stop] if stop < len(counts) else 0
            finals = slice(final_stop - (counts[first] - n_next), final_stop)
            with torch.enable_grad():
                inputs = [x[rows].detach().requires_grad_(i in wanted) for i, x in enumerate((q, k, v, g, beta))]
                state = state.detach().requires_grad_(first > 0 or ctx.needs_input_grad[5])
                *intra_chunk, _ = _intra_chunk(*inputs, ctx.rep, ctx.use_qk_l2norm, inverse)
                out, final, state_out = _scan_steps(*intra_chunk, state, counts[first:stop], n_next)
                pairs = [(out, grad_out[rows]), (final, grad_finals[finals])]
                if grad_state is not None:
                    pairs.append((state_out, grad_state))
                targets = [inputs[i] for i in wanted] + ([state] if state.requires_grad else [])
                outputs, grad_outputs = zip(*pairs)
                found = torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True) if targets else []
            for i, grad in zip(wanted, found):
                grads[i][rows] = 0 if grad is None else grad
            grad_state = found[-1] if state.requires_grad else None
            row_stop, final_stop = rows.start, finals.start
        return *grads, grad_state, None, None, None, None


def chunk_gated_delta_rule_packed(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    seg_starts: Sequence[int],
    seg_lens: Sequence[int],
    initial_state_NHKV: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool = True,
    chunk: int = CHUNK,
    entering: Callable[[torch.Tensor], torch.Tensor] | None = None,
    plan: SegmentPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over contiguous segments of one packed sequence, each from its own initial state.

    `q/k`: `[T, Hk, dk]`, `v`: `[T, Hv, dv]` (value head h reads key head h // (Hv/Hk)), `g`, `beta`: `[T, Hv]`.
    Returns the outputs `[T, Hv, dv]` and every segment's final state `[N, Hv, dk, dv]`, in fp32 (fp64 for fp64
    inputs).

    `entering` (ring CP): called with the final states, returns every segment's true entering state
    `[N, Hv, dk, dv']`; then `v` carries `dv'` value columns and `dk` more whose outputs are `A_tᵀ q_t`
    (values zero, initial state `[0 | I]`), and the outputs returned are the first `dv'` columns plus
    `S_inᵀ A_tᵀ q_t` (chunk by chunk, batched like the scan).

    `plan`: the segments' index tensors on the inputs' device (`SegmentPlan`); without one they are built here.
    """
    T, Hk, dk = q_THK.shape
    Hv, dv = v_THV.shape[1:]
    dtype = _compute_dtype(v_THV)
    n_seg = len(seg_starts)
    if plan is None:
        plan = SegmentPlan(seg_starts, seg_lens, 1, q_THK.device, chunk=chunk)
    assert plan.chunk == chunk and plan.lens == tuple(seg_lens), "the plan is of other segments"
    counts, n_chunks, inverse = plan.counts, plan.n_chunks, plan.chunk_inverse

    def grid(x):  # [T, H, ...] → [n_chunks, H, chunk, ...]
        out = _ToSlots.apply(x, inverse, n_chunks * chunk).reshape(n_chunks, chunk, *x.shape[1:])
        return out.transpose(1, 2)

    if initial_state_NHKV is None:
        state = v_THV.new_zeros(n_seg, Hv, dk, dv, dtype=dtype)
    else:
        state = initial_state_NHKV.to(dtype).index_select(0, plan.order)
    out, finals = _ChunkScan.apply(
        *(grid(x) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH)),
        state,
        counts,
        _step_groups(counts, _RECOMPUTE_CHUNKS),
        Hv // Hk,
        use_qk_l2norm,
    )
    finals = finals.index_select(0, plan.final_where)
    if entering is not None:
        dv = dv - dk
        state_in = entering(finals).index_select(0, plan.order)  # sorted like the scan
        out = torch.cat([o[..., :dv] + o[..., dv:] @ state_in[:n] for o, n in zip(out.split(counts), counts)])
    out = out.transpose(1, 2).reshape(n_chunks * chunk, Hv, dv)
    return _FromSlots.apply(out, inverse), finals


def _fla_applies(q: torch.Tensor, kernel: str) -> bool:
    return kernel != "torch" and q.is_cuda and _fla_chunk() is not None


def resolve_gdn_kernel(kernel: str, device_type: str) -> tuple[str, str]:
    """The implementation that runs for `model.gdn_kernel: kernel` on `device_type` ("fla" or "torch") and why.
    Under ring context parallel the torch path runs whatever this says (the ring chains the chunks' states)."""
    if kernel not in GDN_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(GDN_KERNELS)}, got {kernel!r}")
    if kernel == "torch":
        return "torch", "model.gdn_kernel: torch"
    if device_type != "cuda":
        return "torch", f"fla's Triton kernels run on CUDA only, this is {device_type}"
    if _fla_chunk() is None:
        return "torch", "fla is not installed (the `fla` extra of mmfsdp-model: flash-linear-attention)"
    return "fla", f"model.gdn_kernel: {kernel}, fla is installed"


def _fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state):
    """fla's chunk kernel over whole samples (CUDA; `cu_seqlens` int64 on the device): same contract as
    `chunk_gated_delta_rule_packed`."""
    fla_chunk = _fla_chunk()
    Hk, Hv = q.size(1), v.size(1)
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    out, final = fla_chunk(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.float().unsqueeze(0),
        beta.unsqueeze(0),
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0].float(), final.float()
