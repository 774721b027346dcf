"""Gated DeltaNet (the linear-attention layer of hybrid decoders), exact under packing and context parallel.

`gated_deltanet_forward(module, hidden_states, cu_seq_lens=None, cp=None)` runs a
module shaped like transformers' `*GatedDeltaNet` (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`, `conv1d`, `A_log`, `dt_bias`, `norm`, `out_proj`, the head
counts and dims) and equals that module run on every sample alone. HF's torch
fallback ignores `cu_seq_lens`: its convolution and its recurrent state run from
one packed sample into the next. Here every sample boundary resets both.

The layer, per token t of a sample (HF's maths; S is a `dk × dv` state per value head):

    x = in_proj_qkv(h);  x' = act(causal depthwise conv(x) + bias)  → q, k (per key head), v (per value head)
    q, k ← l2norm(q), l2norm(k);  q ← q / √dk;  β = σ(in_proj_b(h));  g = −exp(A_log)·softplus(in_proj_a(h) + dt_bias)
    S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ;   o_t = S_tᵀ q_t
    out = out_proj(norm(o, z = in_proj_z(h)))

Pieces (each usable alone, on plain tensors):

- `packed_causal_conv1d`: the depthwise causal convolution over segments of a
  packed sequence; each segment is preceded by `kernel − 1` halo inputs (zeros
  at a sample start, the previous part's last inputs under context parallel).
  One `F.conv1d` over the sequence with the halos spliced in.
- `chunk_gated_delta_rule_packed`: the chunked gated delta rule (chunk 64, the UT
  transform of HF / fla) over segments with a per-segment initial state and final
  state. Every segment is chunked from its own start; the intra-chunk algebra is
  one batched computation over all chunks of all segments, the scan over chunks
  is batched over the segments (sorted by chunk count, the batch shrinks as
  segments end), so the loop runs `max chunks per segment` steps — no more than
  HF's fallback on the longest sample alone. With `fla` importable and CUDA
  tensors, the whole-sample case goes to `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
  with `cu_seqlens` (`kernel="auto"`; `"torch"` forces the code here).

Context parallel (`cp`: an object with `layout` (`CPLayout`), `ring_group`, `ulysses_group`,
i.e. `mmfsdp.model.context_parallel.CPContext`):

- Ring (sequence): the layout cuts every sample into 2·R equal chunks, ring rank r
  holds chunks r and 2R−1−r. The recurrence is affine in the entering state:
  over one chunk, S_end = A·S_0 + R (A: `dk × dk` per head) and o_t = o⁰_t + S_0ᵀ q̃_t
  with q̃_t = A_tᵀ q_t. Each rank computes its chunks at once, with the values
  widened by `dk` zero columns and the entering state `[0 | I]`: the same kernel then
  returns o⁰ and q̃ as its output columns and `[R | A]` as its final state. The
  ranks all-gather `[R | A]` of every chunk (autograd-aware), every rank folds the
  chain S_in(c+1) = A_c·S_in(c) + R_c for each sample (from the sample's initial
  state) and adds S_in(c)ᵀ q̃_t to the outputs of its chunk c. The convolution halo:
  the ranks all-gather the last `kernel − 1` pre-convolution inputs of each chunk;
  a chunk takes those of the chunks before it in its sample (zeros at chunk 0).
  Cost per layer and rank, N samples in the row: communication 2N·H·dk·(dk+dv) +
  2N·(kernel−1)·conv_dim elements gathered from each rank (backward: an all-reduce
  of R times that); extra flops: the kernel's value width grows from dv to dv+dk
  (≈ 2× the state-side matmuls when dk = dv), the fold is 2R small `dk×dk @ dk×(dv+dk)`
  products per sample and head, the correction one `T×dk @ dk×dv` per head. Exact:
  no approximation, only re-association of sums.
- Ulysses (heads): after the projections, one all-to-all moves every rank's
  tokens of q/k (by key head), v/z/β/g-inputs (by value head) to the rank owning
  those heads — key heads u·Hk/U…, with their Hv/Hk value heads each — so each rank
  runs the whole (ring-local) sequence for its heads; the output (after the gated
  norm, which is per head) goes back with the inverse all-to-all before `out_proj`.
  Needs `num_k_heads % U == 0`.
- Hybrid: Ulysses inside, the ring above on the ring-local sequence of the local heads.

Shape legend: B batch, T tokens, D hidden, Hk key heads, Hv value heads, dk/dv head dims, C conv channels,
K conv kernel, N samples/segments.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from mmfsdp.parallel.cp.gather import all_gather_with_grad
from mmfsdp.parallel.cp.ulysses import heads_to_seq, seq_to_heads

__all__ = [
    "GDN_KERNELS",
    "GatedDeltaNetPlan",
    "SegmentPlan",
    "chunk_gated_delta_rule_packed",
    "gated_deltanet_forward",
    "packed_causal_conv1d",
    "plan_batch_layers",
    "plan_gated_deltanet",
    "resolve_gdn_kernel",
    "set_kernel",
    "use_packed_forward",
]

CHUNK = 64
_L2_EPS = 1e-6
GDN_KERNELS = ("auto", "torch", "fla")
"""The chunked delta rule's implementations: "torch" (this module), "fla" (fla's Triton kernel, CUDA), "auto" (fla
where it can run, else torch)."""
PLAN_NAME = "gated_deltanet"
"""The name of the Gated DeltaNet's part of a `BatchPlan` (`BatchPlan.layers`)."""


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
    if Hv != Hk:
        q_THK = q_THK.repeat_interleave(Hv // Hk, dim=1)
        k_THK = k_THK.repeat_interleave(Hv // Hk, dim=1)
    dtype = _compute_dtype(v_THV)
    q, k, v, g, beta = (x.to(dtype) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * dk**-0.5
    device = q.device
    n_seg = len(seg_starts)
    if plan is None:
        plan = SegmentPlan(seg_starts, seg_lens, 1, device, chunk=chunk)
    assert plan.chunk == chunk and plan.lens == tuple(seg_lens), "the plan is of other segments"
    counts, n_chunks, inverse = plan.counts, plan.n_chunks, plan.chunk_inverse

    def grid(x):  # [T, H, ...] → [n_chunks, H, chunk, ...]
        out = _ToSlots.apply(x, inverse, n_chunks * chunk).reshape(n_chunks, chunk, *x.shape[1:])
        return out.transpose(1, 2)

    q, k, v, g, beta = grid(q), grid(k), grid(v), grid(g), grid(beta)
    # intra-chunk (all chunks at once)
    cum = g.cumsum(-1)  # [n, H, c]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [n, H, c, c]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    # scan over chunk steps, batched over the segments still running
    if initial_state_NHKV is None:
        state = q.new_zeros(n_seg, Hv, dk, dv)
    else:
        state = initial_state_NHKV.to(dtype).index_select(0, plan.order)
    outs, finals = [], []
    # one split per operand (its backward is one concatenation), not a slice per step: a slice's backward writes a
    # zero tensor the size of the whole operand, which made the scan's backward quadratic in the chunk count
    per_step = zip(counts, *(x.split(counts) for x in (u, w, q_dec, intra, k_dec, chunk_decay)))
    for j, (n, u_j, w_j, q_dec_j, intra_j, k_dec_j, decay_j) in enumerate(per_step):
        state = state[:n]
        v_new = u_j - w_j @ state
        outs.append(q_dec_j @ state + intra_j @ v_new)
        state = state * decay_j + k_dec_j.transpose(-1, -2) @ v_new
        n_next = counts[j + 1] if j + 1 < len(counts) else 0
        finals.append(state[n_next:])
    finals = torch.cat(finals).index_select(0, plan.final_where)
    if entering is not None:
        dv = dv - dk
        state_in = entering(finals).index_select(0, plan.order)  # sorted like the scan
        for j, n in enumerate(counts):
            outs[j] = outs[j][..., :dv] + outs[j][..., dv:] @ state_in[:n]
    out = torch.cat(outs).transpose(1, 2).reshape(n_chunks * chunk, Hv, dv)
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


# ---------------------------------------------------------------------------------------------------------------
# the layer


def _check_bounds(cu_seq_lens, B: int, T: int) -> tuple[int, ...]:
    if cu_seq_lens is None:
        return tuple(range(0, B * T + 1, T))
    bounds = tuple(int(x) for x in (cu_seq_lens.tolist() if torch.is_tensor(cu_seq_lens) else cu_seq_lens))
    if B != 1:
        raise ValueError(f"a packed batch (cu_seq_lens given) must be one row, got batch size {B}")
    if bounds[0] != 0 or bounds[-1] != T or any(e <= s for s, e in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seq_lens must rise strictly from 0 to the sequence length {T}, got {list(bounds)}")
    return bounds


def _ring_segments(layout, rows: int):
    """Ring-local segments of `rows` rows: (sample id, chain position, start, length), local order."""
    R, r = layout.ring_size, layout.ring_rank
    bounds = layout.cu_seq_lens
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    local_len = sum(lengths) // R
    segs = []
    for b in range(rows):
        start = b * local_len
        for i, n in enumerate(lengths):
            piece = n // (2 * R)
            for c in (r, 2 * R - 1 - r):
                segs.append((b * len(lengths) + i, c, start, piece))
                start += piece
    return segs, rows * len(lengths)


def _ring_halo_indices(segs, K: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of `_ring_halos`: the rows of this rank's tails (T: a zero row) and, in the gathered tails of all
    ranks, the row of every halo row (past the end: a zero row)."""
    n_seg = len(segs)
    T = sum(s[3] for s in segs)
    starts = torch.tensor([s[2] for s in segs])
    lens = torch.tensor([s[3] for s in segs])
    chain = torch.tensor([s[1] for s in segs])
    rows = torch.arange(K - 1)
    tail_tok = starts[:, None] + lens[:, None] - (K - 1) + rows[None, :]
    tails = torch.where(tail_tok >= starts[:, None], tail_tok, T).reshape(-1)
    token = chain[:, None] * lens[:, None] - (K - 1) + rows[None, :]
    prev = torch.div(token.clamp_min(0), lens[:, None], rounding_mode="floor")
    pos = token.clamp_min(0) - prev * lens[:, None]
    owner = torch.minimum(prev, 2 * R - 1 - prev)
    pair = (torch.arange(n_seg) - torch.arange(n_seg) % 2)[:, None]  # a sample's two local segments: 2s, 2s+1
    seg_on_owner = pair + (prev >= R).long()
    source = (owner * n_seg + seg_on_owner) * (K - 1) + (K - 1) - (lens[:, None] - pos)
    source = torch.where(token >= 0, source, R * n_seg * (K - 1)).reshape(-1)
    return tails, source


def _ring_halos(x_TC, plan: GatedDeltaNetPlan, K, group):
    """Each segment's K−1 preceding pre-conv inputs: from the chunks before it in its sample (any rank).

    Every rank contributes the last `min(ℓ, K−1)` inputs of each of its chunks (left-padded to K−1); halo row m
    of chunk c (chunk length ℓ) is the sample's token `c·ℓ − (K−1) + m`: zero before the sample, else row
    `K−1 − (ℓ − pos)` of the tail of chunk `c' = token // ℓ` (pos = token % ℓ), held by rank min(c', 2R−1−c').
    """
    C = x_TC.size(1)
    n_seg = len(plan.segments.starts)
    if K == 1:
        return x_TC.new_zeros(n_seg, 0, C)
    tails = torch.cat([x_TC, x_TC.new_zeros(1, C)]).index_select(0, plan.halo_tails)
    gathered = all_gather_with_grad(tails.reshape(n_seg, K - 1, C), group).reshape(-1, C)  # [R·n_seg·(K−1), C]
    halos = torch.cat([gathered, gathered.new_zeros(1, C)]).index_select(0, plan.halo_source)
    return halos.reshape(n_seg, K - 1, C)


def _ring_delta_rule(q, k, v, g, beta, plan: GatedDeltaNetPlan, initial_state, group, R):
    """The gated delta rule over the ring's 2R chunks per sample; returns this rank's outputs `[T, Hv, dv]`."""
    T, Hv, dv = v.shape
    dk = q.size(-1)
    n_seg, n_samples = len(plan.segments.starts), plan.num_samples
    dtype = _compute_dtype(v)
    v_aug = torch.cat([v.to(dtype), v.new_zeros(T, Hv, dk, dtype=dtype)], -1)
    eye = torch.eye(dk, device=v.device, dtype=dtype)
    init = torch.cat([v.new_zeros(n_seg, Hv, dk, dv, dtype=dtype), eye.expand(n_seg, Hv, dk, dk)], -1)

    def entering(final):  # [n_seg, Hv, dk, dv + dk]: [R_c | A_c] of this rank's chunks
        gathered = all_gather_with_grad(final, group)  # every rank's
        state = v.new_zeros(n_samples, Hv, dk, dv, dtype=dtype) if initial_state is None else initial_state.to(dtype)
        sample_rows = torch.arange(n_samples, device=v.device) * 2
        chain = []
        for c in range(2 * R):  # fold every sample's chain (samples batched)
            chain.append(state)
            owner, slot = min(c, 2 * R - 1 - c), 0 if c < R else 1
            RA = gathered[owner].index_select(0, sample_rows + slot)
            state = RA[..., dv:] @ state + RA[..., :dv]
        chain = torch.stack(chain)  # [2R, n_samples, Hv, dk, dv]
        # local segment 2s + slot is (sample s, chain position r if slot == 0 else 2R-1-r), on every rank
        return chain[plan.seg_chain, plan.seg_sample]

    seg = plan.segments
    out, _ = chunk_gated_delta_rule_packed(
        q, k, v_aug, g, beta, seg.starts, seg.lens, init, entering=entering, plan=seg
    )
    return out


class GatedDeltaNetPlan:
    """What every Gated DeltaNet layer of one forward reads: the (ring-local) segments' index tensors (`segments`,
    a `SegmentPlan`), the number of samples (per-sample initial states) and, under ring context parallel, the halo
    exchange's rows (`halo_tails`, `halo_source`) and each local segment's place in its sample's chain
    (`seg_chain`, `seg_sample`). Built on the host by `plan_gated_deltanet`, once per micro-batch, the tensors on
    the device (pinned, non-blocking); the layers only read it."""

    def __init__(self, segments: SegmentPlan, num_samples: int, ring: dict[str, torch.Tensor] | None, device):
        self.segments, self.num_samples, self.ring = segments, num_samples, ring is not None
        for name, tensor in (ring or {}).items():
            setattr(self, name, upload(tensor, device))


def plan_gated_deltanet(
    batch_size: int,
    seq_len: int,
    conv_kernel: int,
    device: torch.device | str,
    *,
    bounds: Sequence[int] | None = None,
    layout: Any = None,
    chunk: int = CHUNK,
) -> GatedDeltaNetPlan:
    """The plan of the layer's input `[batch_size, seq_len, D]`: `bounds` (host sample bounds of a packed row,
    `batch_size == 1`) or None (every row one sample); under context parallel the `CPLayout` instead (the input is
    then this rank's shard, the segments those of the ring-local sequence)."""
    device = torch.device(device)
    if layout is None:
        bounds = _check_bounds(bounds, batch_size, seq_len)
        starts, lens = bounds[:-1], [e - s for s, e in itertools.pairwise(bounds)]
        return GatedDeltaNetPlan(SegmentPlan(starts, lens, conv_kernel, device, chunk=chunk), len(lens), None, device)
    rows = batch_size
    num_samples = rows * (len(layout.cu_seq_lens) - 1)
    if layout.ring_size > 1:
        segs, _ = _ring_segments(layout, rows)
        segments = SegmentPlan([s[2] for s in segs], [s[3] for s in segs], conv_kernel, device, chunk=chunk)
        ring = dict(
            seg_chain=torch.tensor([s[1] for s in segs], dtype=torch.long),
            seg_sample=torch.tensor([s[0] for s in segs], dtype=torch.long),
        )
        if conv_kernel > 1:
            ring["halo_tails"], ring["halo_source"] = _ring_halo_indices(segs, conv_kernel, layout.ring_size)
        return GatedDeltaNetPlan(segments, num_samples, ring, device)
    ring_local = layout.seq_len // layout.ring_size
    local_bounds = layout.local_cu_seq_lens() or (0, ring_local)
    bounds = tuple(b * ring_local + x for b in range(rows) for x in local_bounds[:-1]) + (rows * ring_local,)
    starts, lens = bounds[:-1], [e - s for s, e in itertools.pairwise(bounds)]
    return GatedDeltaNetPlan(SegmentPlan(starts, lens, conv_kernel, device, chunk=chunk), num_samples, None, device)


class _Heads:
    """The module's dimensions and (possibly head-sliced) per-channel parameters."""

    def __init__(self, module: Any):
        self.Hk, self.Hv = int(module.num_k_heads), int(module.num_v_heads)
        self.dk, self.dv = int(module.head_k_dim), int(module.head_v_dim)
        self.K = int(module.conv_kernel_size)
        self.activation = module.activation
        self.conv_w = module.conv1d.weight.squeeze(1)  # [C, K]
        self.conv_b = module.conv1d.bias
        self.A_log, self.dt_bias = module.A_log, module.dt_bias

    def local(self, U: int, u: int) -> _Heads:
        """This Ulysses rank's heads: key heads u·Hk/U…, value heads u·Hv/U… (conv channels in the same order)."""
        new = object.__new__(_Heads)
        new.__dict__.update(self.__dict__)
        hk, hv = self.Hk // U, self.Hv // U
        key_dim = self.Hk * self.dk
        q_ch = slice(u * hk * self.dk, (u + 1) * hk * self.dk)
        k_ch = slice(key_dim + q_ch.start, key_dim + q_ch.stop)
        v_ch = slice(2 * key_dim + u * hv * self.dv, 2 * key_dim + (u + 1) * hv * self.dv)

        def channels(x):
            return torch.cat([x[q_ch], x[k_ch], x[v_ch]])

        new.conv_w = channels(self.conv_w)
        new.conv_b = None if self.conv_b is None else channels(self.conv_b)
        new.A_log, new.dt_bias = self.A_log[u * hv : (u + 1) * hv], self.dt_bias[u * hv : (u + 1) * hv]
        new.Hk, new.Hv = hk, hv
        return new


def _core(heads: _Heads, mixed_TC, b_TH, a_TH, plan: GatedDeltaNetPlan, ring_group, ring_size, initial_state, kernel):
    """conv → delta rule over one flattened (ring-local) sequence of the local heads; `[T, Hv, dv]`."""
    key_dim, value_dim = heads.Hk * heads.dk, heads.Hv * heads.dv
    T = mixed_TC.size(0)
    seg = plan.segments
    halos = _ring_halos(mixed_TC, plan, heads.K, ring_group) if plan.ring else None
    conv = packed_causal_conv1d(
        mixed_TC, heads.conv_w, heads.conv_b, heads.activation, seg.starts, seg.lens, halos, plan=seg
    )
    q, k, v = torch.split(conv, [key_dim, key_dim, value_dim], dim=-1)
    q, k = q.reshape(T, heads.Hk, heads.dk), k.reshape(T, heads.Hk, heads.dk)
    v = v.reshape(T, heads.Hv, heads.dv)
    beta = b_TH.sigmoid()
    dtype = _compute_dtype(a_TH)
    g = -heads.A_log.to(dtype).exp() * F.softplus(a_TH.to(dtype) + heads.dt_bias)
    if plan.ring:
        core = _ring_delta_rule(q, k, v, g, beta, plan, initial_state, ring_group, ring_size)
    elif _fla_applies(q, kernel):
        core, _ = _fla_gated_delta_rule(q, k, v, g, beta, seg.cu_seqlens, initial_state)
    else:
        core, _ = chunk_gated_delta_rule_packed(q, k, v, g, beta, seg.starts, seg.lens, initial_state, plan=seg)
    return core.to(mixed_TC.dtype)


def gated_deltanet_forward(
    module: Any,
    hidden_states: torch.Tensor,
    cu_seq_lens: torch.Tensor | Sequence[int] | None = None,
    cp: Any = None,
    *,
    initial_state: torch.Tensor | None = None,
    kernel: str = "auto",
    plan: GatedDeltaNetPlan | None = None,
) -> torch.Tensor:
    """The Gated DeltaNet layer `module` on `hidden_states` `[B, T, D]`, every sample exactly on its own.

    Without `cp`: `cu_seq_lens` (one packed row, `B == 1`) or None (every row one sample).
    With `cp` (`layout`, `ring_group`, `ulysses_group`; `hidden_states` is this rank's shard
    as cut by `split_for_cp` with `cp.layout`): the layout's samples, Ring / Ulysses / Hybrid;
    `cu_seq_lens` is then ignored (the layout holds it).
    `plan`: the micro-batch's `GatedDeltaNetPlan` (`plan_gated_deltanet` of the same input and layout), which
    replaces `cu_seq_lens`; without one the call builds its own (reading `cu_seq_lens` on the host).
    `initial_state`: `[N, Hv, dk, dv]`, one state per sample (rows, or packed samples), or None (zeros).
    `kernel`: "auto" (fla on CUDA when importable, outside ring CP), "fla" (the same; the caller has warned where
    fla cannot run) or "torch".
    Returns `[B, T, D]` in the input dtype.
    """
    if kernel not in GDN_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(GDN_KERNELS)}, got {kernel!r}")
    B, T, _ = hidden_states.shape
    heads = _Heads(module)
    layout = None if cp is None else cp.layout
    ring_group = None if cp is None else cp.ring_group
    ulysses_group = None if cp is None else cp.ulysses_group
    U = 1 if layout is None else layout.ulysses_size
    if layout is not None and layout.packed and B != 1:
        raise ValueError(f"a packed batch under context parallel must be one row, got batch size {B}")
    if plan is None:
        plan = plan_gated_deltanet(B, T, heads.K, hidden_states.device, bounds=cu_seq_lens, layout=layout)

    if initial_state is not None:
        want = (plan.num_samples, heads.Hv, heads.dk, heads.dv)
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must have shape {want} (samples, value heads, dk, dv), got {tuple(initial_state.shape)}"
            )

    mixed = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b = module.in_proj_b(hidden_states)
    a = module.in_proj_a(hidden_states)
    if U > 1:
        if heads.Hk % U:
            raise ValueError(
                f"Ulysses context parallel of size {U} splits the Gated DeltaNet by key head: "
                f"linear_num_key_heads ({heads.Hk}) must be divisible by it"
            )
        u = layout.ulysses_rank
        local = heads.local(U, u)
        mixed, z, b, a = _ulysses_in(heads, mixed, z, b, a, U, ulysses_group)
        if initial_state is not None:
            initial_state = initial_state[:, u * local.Hv : (u + 1) * local.Hv]
        heads = local
    Bq, Tq = mixed.shape[:2]
    if sum(plan.segments.lens) != Bq * Tq:
        raise ValueError(f"the Gated DeltaNet plan covers {sum(plan.segments.lens)} tokens, the input {Bq * Tq}")
    core = _core(
        heads,
        mixed.reshape(Bq * Tq, -1),
        b.reshape(Bq * Tq, heads.Hv),
        a.reshape(Bq * Tq, heads.Hv),
        plan,
        ring_group,
        1 if layout is None else layout.ring_size,
        initial_state,
        kernel,
    )
    normed = module.norm(core.reshape(-1, heads.dv), z.reshape(-1, heads.dv)).reshape(Bq, Tq, -1)
    if U > 1:
        normed = _ulysses_out(normed, U, ulysses_group)
    return module.out_proj(normed)


def set_kernel(module: Any, kernel: str) -> None:
    """The delta rule's implementation (`GDN_KERNELS`) a module routed by `use_packed_forward` runs."""
    if kernel not in GDN_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(GDN_KERNELS)}, got {kernel!r}")
    module.gdn_kernel = kernel


def use_packed_forward(module: Any, kernel: str = "auto") -> None:
    """Make `module(hidden_states, cache=None, attention_mask=None, **kwargs)` (HF's call from its decoder layer)
    run `gated_deltanet_forward` with `kernel` (`module.gdn_kernel`, `set_kernel`): the micro-batch's
    `GatedDeltaNetPlan` from the training forward's `BatchPlan` (`mmfsdp.model.batch_plan.BATCH_PLAN_KEY`, built
    before the decoder runs), else the packed boundaries from `cu_seq_lens_q`; the `CPContext` from the decoder's
    CP keyword (`CP_CONTEXT_KEY`, the one the CP attention reads: the decoder layers pass their keywords to the
    token mixer). A call with a cache (generation, decoding) runs the module's original forward; a 2-D padding
    mask zeroes the padded inputs as HF does. Packed rows (`cu_seq_lens_q` over all `B·T` tokens, as the collator
    writes them; samples never cross rows) run as one row of `B·T` tokens."""
    from mmfsdp.model.batch_plan import BATCH_PLAN_KEY
    from mmfsdp.model.context_parallel import CP_CONTEXT_KEY

    set_kernel(module, kernel)
    original = module.forward

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None or kwargs.get("cache_params") is not None:
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        cu_seq_lens, cp = kwargs.get("cu_seq_lens_q"), kwargs.get(CP_CONTEXT_KEY)
        batch_plan = kwargs.get(BATCH_PLAN_KEY)
        plan = None if batch_plan is None else batch_plan.layers.get(PLAN_NAME)
        kernel = module.gdn_kernel
        if cu_seq_lens is None or cp is not None:
            return gated_deltanet_forward(module, hidden_states, cu_seq_lens, cp, kernel=kernel, plan=plan)
        B, T, D = hidden_states.shape
        out = gated_deltanet_forward(module, hidden_states.reshape(1, B * T, D), cu_seq_lens, kernel=kernel, plan=plan)
        return out.reshape(B, T, -1)

    module.forward = forward


# ---------------------------------------------------------------------------------------------------------------
# Ulysses


def _ulysses_in(heads: _Heads, mixed, z, b, a, U: int, group):
    """Sequence-split `[B, T/U, ·]` projections → head-split `[B, T, ·]` of this rank's heads (one all-to-all)."""
    B, Tl = mixed.shape[:2]
    key_dim = heads.Hk * heads.dk
    q, k, v = torch.split(mixed, [key_dim, key_dim, heads.Hv * heads.dv], dim=-1)
    parts = [q, k, v, z, b, a]
    widths = [p.size(-1) // U for p in parts]
    packed = torch.cat([p.reshape(B, Tl, U, -1) for p in parts], -1)  # [B, T/U, U, per-rank channels]
    local = seq_to_heads(packed, group).squeeze(2)  # [B, T, per-rank channels]
    q, k, v, z, b, a = torch.split(local, widths, dim=-1)
    return torch.cat([q, k, v], -1), z, b, a


def _ulysses_out(x_BTF: torch.Tensor, U: int, group) -> torch.Tensor:
    B, T, F_ = x_BTF.shape
    return heads_to_seq(x_BTF.unsqueeze(2), group).reshape(B, T // U, U * F_)


def plan_batch_layers(batch_plan: Any, layout: Any, conv_kernel: int) -> None:
    """Add the Gated DeltaNet's plan (`PLAN_NAME`) to a micro-batch's `BatchPlan`: of the packed row (its `B·S`
    tokens as one row, as `use_packed_forward` runs it) or of the rows, or of this rank's `layout` under context
    parallel (one row when packed)."""
    from mmfsdp.model.host_syncs import host_side

    B, S, packed = batch_plan.batch_size, batch_plan.seq_len, batch_plan.bounds is not None
    with host_side():
        if layout is not None:
            plan = plan_gated_deltanet(1 if layout.packed else B, S, conv_kernel, batch_plan.device, layout=layout)
        elif packed:
            plan = plan_gated_deltanet(1, B * S, conv_kernel, batch_plan.device, bounds=batch_plan.bounds)
        else:
            plan = plan_gated_deltanet(B, S, conv_kernel, batch_plan.device)
    batch_plan.layers[PLAN_NAME] = plan
