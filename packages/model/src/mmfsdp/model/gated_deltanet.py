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
    "chunk_gated_delta_rule_packed",
    "gated_deltanet_forward",
    "packed_causal_conv1d",
    "use_packed_forward",
]

CHUNK = 64
_L2_EPS = 1e-6


def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means: no fla kernel
        return None
    return chunk_gated_delta_rule


# ---------------------------------------------------------------------------------------------------------------
# convolution


def packed_causal_conv1d(
    x_TC: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    activation: str | None,
    seg_starts: Sequence[int],
    seg_lens: Sequence[int],
    halo_NKC: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of `x_TC` over contiguous segments covering `[0, T)`.

    Segment n sees, before its first token, `halo_NKC[n]` (`K − 1` inputs, oldest first;
    zeros when None), never the tokens of the segment before it. Returns `[T, C]`.
    """
    T, C = x_TC.shape
    K = weight_CK.size(-1)
    n_seg = len(seg_starts)
    if halo_NKC is None:
        halo_NKC = x_TC.new_zeros(n_seg, K - 1, C)
    # source rows: the tokens, then the halos; ext = for each segment, its halo then its tokens
    src = torch.cat([x_TC, halo_NKC.reshape(-1, C).to(x_TC.dtype)])
    starts = torch.tensor(list(seg_starts), dtype=torch.long)
    lens = torch.tensor(list(seg_lens), dtype=torch.long)
    seg_of_ext = torch.repeat_interleave(torch.arange(n_seg), lens + K - 1)
    ext_starts = torch.cumsum(lens + K - 1, 0) - (lens + K - 1)
    pos = torch.arange(int(seg_of_ext.numel())) - ext_starts[seg_of_ext] - (K - 1)  # < 0: halo row
    is_tok = pos >= 0
    index = torch.where(is_tok, starts[seg_of_ext] + pos, T + seg_of_ext * (K - 1) + pos + (K - 1))
    ext = src.index_select(0, index.to(x_TC.device))  # [E, C]
    out = F.conv1d(ext.t().unsqueeze(0).to(weight_CK.dtype), weight_CK.unsqueeze(1), bias_C, groups=C)[0]
    # output j covers ext rows j .. j+K-1, i.e. the token at ext row j+K-1
    keep = torch.nonzero(is_tok).squeeze(1) - (K - 1)
    out = out.index_select(1, keep.to(out.device)).t().contiguous()
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


class _Regroup(torch.autograd.Function):
    """`x[index]` with `index` in `[0, len(x)]` (the end: a zero row), where `inverse` maps back: every row of `x`
    appears exactly once in the result (`result[inverse] == x`). Forward and backward are both gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, inverse)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, inverse = ctx.saved_tensors
        return _Regroup.apply(grad, inverse, index), None, None


def _chunk_plan(seg_lens: Sequence[int], chunk: int):
    """Step-major order of all chunks: step j holds chunk j of the segments with more than j chunks (longest first)."""
    n_chunks = [max(1, math.ceil(n / chunk)) for n in seg_lens]
    order = sorted(range(len(seg_lens)), key=lambda s: (-n_chunks[s], s))
    counts = [sum(1 for n in n_chunks if n > j) for j in range(max(n_chunks, default=0))]
    chunk_seg = [order[i] for j, n in enumerate(counts) for i in range(n)]
    chunk_j = [j for j, n in enumerate(counts) for _ in range(n)]
    return order, counts, chunk_seg, chunk_j


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over contiguous segments of one packed sequence, each from its own initial state.

    `q/k`: `[T, Hk, dk]`, `v`: `[T, Hv, dv]` (value head h reads key head h // (Hv/Hk)), `g`, `beta`: `[T, Hv]`.
    Returns the outputs `[T, Hv, dv]` and every segment's final state `[N, Hv, dk, dv]`, in fp32 (fp64 for fp64
    inputs).

    `entering` (ring CP): called with the final states, returns every segment's true entering state
    `[N, Hv, dk, dv']`; then `v` carries `dv'` value columns and `dk` more whose outputs are `A_tᵀ q_t`
    (values zero, initial state `[0 | I]`), and the outputs returned are the first `dv'` columns plus
    `S_inᵀ A_tᵀ q_t` (chunk by chunk, batched like the scan).
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
    order, counts, chunk_seg, chunk_j = _chunk_plan(seg_lens, chunk)
    n_chunks = len(chunk_seg)

    # token index of every (chunk, position) slot; T (a zero row) for the padding after a segment's end
    cs = torch.tensor(chunk_seg, dtype=torch.long)
    cj = torch.tensor(chunk_j, dtype=torch.long)
    ar = torch.arange(chunk)
    starts = torch.tensor(list(seg_starts), dtype=torch.long)
    lens = torch.tensor(list(seg_lens), dtype=torch.long)
    within = cj[:, None] * chunk + ar[None, :]
    valid = within < lens[cs][:, None]
    index = torch.where(valid, starts[cs][:, None] + within, T).reshape(-1).to(device)

    slot = torch.nonzero(valid.reshape(-1)).squeeze(1)
    inverse = torch.empty(T, dtype=torch.long)
    inverse[index.cpu()[slot]] = slot
    inverse = inverse.to(device)

    def grid(x):  # [T, H, ...] → [n_chunks, H, chunk, ...]
        out = _Regroup.apply(x, index, inverse).reshape(n_chunks, chunk, *x.shape[1:])
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
        state = initial_state_NHKV.to(dtype).index_select(0, torch.tensor(order, device=device))
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
    # finals[j] holds the segments order[n_{j+1}:n_j] (those that end at step j)
    seg_of_final = [s for j, n in enumerate(counts) for s in order[(counts[j + 1] if j + 1 < len(counts) else 0) : n]]
    where = torch.empty(n_seg, dtype=torch.long)
    where[torch.tensor(seg_of_final, dtype=torch.long)] = torch.arange(n_seg)
    finals = torch.cat(finals).index_select(0, where.to(device))
    if entering is not None:
        dv = dv - dk
        state_in = entering(finals).index_select(0, torch.tensor(order, device=device))  # sorted like the scan
        for j, n in enumerate(counts):
            outs[j] = outs[j][..., :dv] + outs[j][..., dv:] @ state_in[:n]
    out = torch.cat(outs).transpose(1, 2).reshape(n_chunks * chunk, Hv, dv)
    return _Regroup.apply(out, inverse, index), finals


def _fla_applies(q: torch.Tensor, kernel: str) -> bool:
    return kernel != "torch" and q.is_cuda and _fla_chunk() is not None


def _fla_gated_delta_rule(q, k, v, g, beta, cu, initial_state):
    """fla's chunk kernel over whole samples (CUDA): same contract as `chunk_gated_delta_rule_packed`."""
    fla_chunk = _fla_chunk()
    Hk, Hv = q.size(1), v.size(1)
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    cu_t = torch.tensor(list(cu), dtype=torch.long, device=q.device)
    out, final = fla_chunk(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.float().unsqueeze(0),
        beta.unsqueeze(0),
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
        cu_seqlens=cu_t,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0].float(), final.float()


# ---------------------------------------------------------------------------------------------------------------
# the layer


def _segments_from_bounds(bounds: Sequence[int]) -> tuple[list[int], list[int]]:
    return list(bounds[:-1]), [e - s for s, e in itertools.pairwise(bounds)]


def _check_bounds(cu_seq_lens, B: int, T: int) -> tuple[int, ...]:
    if cu_seq_lens is None:
        return tuple(range(0, B * T + 1, T))
    bounds = tuple(int(x) for x in (cu_seq_lens.tolist() if torch.is_tensor(cu_seq_lens) else cu_seq_lens))
    if B != 1:
        raise ValueError(f"a packed batch (cu_seq_lens given) must be one row, got batch size {B}")
    if bounds[0] != 0 or bounds[-1] != T or any(e <= s for s, e in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seq_lens must rise strictly from 0 to the sequence length {T}, got {list(bounds)}")
    return bounds


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
        q_ch = torch.arange(u * hk * self.dk, (u + 1) * hk * self.dk)
        v_ch = 2 * key_dim + torch.arange(u * hv * self.dv, (u + 1) * hv * self.dv)
        ch = torch.cat([q_ch, q_ch + key_dim, v_ch]).to(self.conv_w.device)
        new.conv_w = self.conv_w.index_select(0, ch)
        new.conv_b = None if self.conv_b is None else self.conv_b.index_select(0, ch)
        new.A_log, new.dt_bias = self.A_log[u * hv : (u + 1) * hv], self.dt_bias[u * hv : (u + 1) * hv]
        new.Hk, new.Hv = hk, hv
        return new


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


def _ring_halos(x_TC, segs, K, group, R):
    """Each segment's K−1 preceding pre-conv inputs: from the chunks before it in its sample (any rank).

    Every rank contributes the last `min(ℓ, K−1)` inputs of each of its chunks (left-padded to K−1); halo row m
    of chunk c (chunk length ℓ) is the sample's token `c·ℓ − (K−1) + m`: zero before the sample, else row
    `K−1 − (ℓ − pos)` of the tail of chunk `c' = token // ℓ` (pos = token % ℓ), held by rank min(c', 2R−1−c').
    """
    C = x_TC.size(1)
    if K == 1:
        return x_TC.new_zeros(len(segs), 0, C)
    n_seg = len(segs)
    starts = torch.tensor([s[2] for s in segs])
    lens = torch.tensor([s[3] for s in segs])
    chain = torch.tensor([s[1] for s in segs])
    rows = torch.arange(K - 1)
    # this rank's tails
    tail_tok = starts[:, None] + lens[:, None] - (K - 1) + rows[None, :]
    tail_ok = tail_tok >= starts[:, None]
    padded = torch.cat([x_TC, x_TC.new_zeros(1, C)])
    tails = padded.index_select(0, torch.where(tail_ok, tail_tok, x_TC.size(0)).reshape(-1).to(x_TC.device))
    gathered = all_gather_with_grad(tails.reshape(n_seg, K - 1, C), group).reshape(-1, C)  # [R·n_seg·(K−1), C]
    # where every halo row comes from
    token = chain[:, None] * lens[:, None] - (K - 1) + rows[None, :]
    prev = torch.div(token.clamp_min(0), lens[:, None], rounding_mode="floor")
    pos = token.clamp_min(0) - prev * lens[:, None]
    owner = torch.minimum(prev, 2 * R - 1 - prev)
    pair = (torch.arange(n_seg) - torch.arange(n_seg) % 2)[:, None]  # a sample's two local segments: 2s, 2s+1
    seg_on_owner = pair + (prev >= R).long()
    source = (owner * n_seg + seg_on_owner) * (K - 1) + (K - 1) - (lens[:, None] - pos)
    source = torch.where(token >= 0, source, gathered.size(0)).reshape(-1)
    halos = torch.cat([gathered, gathered.new_zeros(1, C)]).index_select(0, source.to(x_TC.device))
    return halos.reshape(n_seg, K - 1, C)


def _ring_delta_rule(q, k, v, g, beta, segs, n_samples, initial_state, group, R):
    """The gated delta rule over the ring's 2R chunks per sample; returns this rank's outputs `[T, Hv, dv]`."""
    T, Hv, dv = v.shape
    dk = q.size(-1)
    n_seg = len(segs)
    dtype = _compute_dtype(v)
    v_aug = torch.cat([v.to(dtype), v.new_zeros(T, Hv, dk, dtype=dtype)], -1)
    eye = torch.eye(dk, device=v.device, dtype=dtype)
    init = torch.cat([v.new_zeros(n_seg, Hv, dk, dv, dtype=dtype), eye.expand(n_seg, Hv, dk, dk)], -1)
    # local segment 2s + slot is (sample s, chain position r if slot == 0 else 2R-1-r), on every rank
    seg_chain = torch.tensor([c for _, c, _, _ in segs], device=v.device)
    seg_sample = torch.tensor([s for s, _, _, _ in segs], device=v.device)

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
        return chain[seg_chain, seg_sample]

    starts, lens = [s[2] for s in segs], [s[3] for s in segs]
    out, _ = chunk_gated_delta_rule_packed(q, k, v_aug, g, beta, starts, lens, init, entering=entering)
    return out


def _core(heads: _Heads, mixed_TC, b_TH, a_TH, bounds, layout, ring_group, rows, initial_state, kernel):
    """conv → delta rule over one flattened (ring-local) sequence of the local heads; `[T, Hv, dv]`."""
    key_dim, value_dim = heads.Hk * heads.dk, heads.Hv * heads.dv
    T = mixed_TC.size(0)
    ring = layout is not None and layout.ring_size > 1
    if ring:
        segs, n_samples = _ring_segments(layout, rows)
        starts, lens = [s[2] for s in segs], [s[3] for s in segs]
        halos = _ring_halos(mixed_TC, segs, heads.K, ring_group, layout.ring_size)
    else:
        starts, lens = _segments_from_bounds(bounds)
        halos = None
    conv = packed_causal_conv1d(mixed_TC, heads.conv_w, heads.conv_b, heads.activation, starts, lens, halos)
    q, k, v = torch.split(conv, [key_dim, key_dim, value_dim], dim=-1)
    q, k = q.reshape(T, heads.Hk, heads.dk), k.reshape(T, heads.Hk, heads.dk)
    v = v.reshape(T, heads.Hv, heads.dv)
    beta = b_TH.sigmoid()
    dtype = _compute_dtype(a_TH)
    g = -heads.A_log.to(dtype).exp() * F.softplus(a_TH.to(dtype) + heads.dt_bias)
    if ring:
        core = _ring_delta_rule(q, k, v, g, beta, segs, n_samples, initial_state, ring_group, layout.ring_size)
    elif _fla_applies(q, kernel):
        core, _ = _fla_gated_delta_rule(q, k, v, g, beta, bounds, initial_state)
    else:
        core, _ = chunk_gated_delta_rule_packed(q, k, v, g, beta, starts, lens, initial_state)
    return core.to(mixed_TC.dtype)


def gated_deltanet_forward(
    module: Any,
    hidden_states: torch.Tensor,
    cu_seq_lens: torch.Tensor | Sequence[int] | None = None,
    cp: Any = None,
    *,
    initial_state: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """The Gated DeltaNet layer `module` on `hidden_states` `[B, T, D]`, every sample exactly on its own.

    Without `cp`: `cu_seq_lens` (one packed row, `B == 1`) or None (every row one sample).
    With `cp` (`layout`, `ring_group`, `ulysses_group`; `hidden_states` is this rank's shard
    as cut by `split_for_cp` with `cp.layout`): the layout's samples, Ring / Ulysses / Hybrid;
    `cu_seq_lens` is then ignored (the layout holds it).
    `initial_state`: `[N, Hv, dk, dv]`, one state per sample (rows, or packed samples), or None (zeros).
    `kernel`: "auto" (fla on CUDA when importable, outside ring CP) or "torch".
    Returns `[B, T, D]` in the input dtype.
    """
    if kernel not in ("auto", "torch"):
        raise ValueError(f"kernel must be 'auto' or 'torch', got {kernel!r}")
    B, T, _ = hidden_states.shape
    heads = _Heads(module)
    layout = None if cp is None else cp.layout
    ring_group = None if cp is None else cp.ring_group
    ulysses_group = None if cp is None else cp.ulysses_group
    U = 1 if layout is None else layout.ulysses_size
    if layout is not None and layout.packed and B != 1:
        raise ValueError(f"a packed batch under context parallel must be one row, got batch size {B}")

    if initial_state is not None:
        samples = B * (len(layout.cu_seq_lens) - 1) if layout is not None else len(_check_bounds(cu_seq_lens, B, T)) - 1
        want = (samples, heads.Hv, heads.dk, heads.dv)
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
    if layout is None:
        bounds = _check_bounds(cu_seq_lens, B, T)
    else:
        local_bounds = layout.local_cu_seq_lens() or (0, Tq)
        bounds = tuple(b_ * Tq + x for b_ in range(Bq) for x in local_bounds[:-1]) + (Bq * Tq,)
    core = _core(
        heads,
        mixed.reshape(Bq * Tq, -1),
        b.reshape(Bq * Tq, heads.Hv),
        a.reshape(Bq * Tq, heads.Hv),
        bounds,
        layout,
        ring_group,
        Bq,
        initial_state,
        kernel,
    )
    normed = module.norm(core.reshape(-1, heads.dv), z.reshape(-1, heads.dv)).reshape(Bq, Tq, -1)
    if U > 1:
        normed = _ulysses_out(normed, U, ulysses_group)
    return module.out_proj(normed)


def use_packed_forward(module: Any) -> None:
    """Make `module(hidden_states, cache=None, attention_mask=None, **kwargs)` (HF's call from its decoder layer)
    run `gated_deltanet_forward`: the packed boundaries from `cu_seq_lens_q`, the `CPContext` from the decoder's
    CP keyword (`CP_CONTEXT_KEY`, the one the CP attention reads: the decoder layers pass their keywords to
    the token mixer). A call with a cache (generation, decoding) runs the module's original forward; a 2-D
    padding mask zeroes the padded inputs as HF does. Packed rows (`cu_seq_lens_q` over all `B·T` tokens, as the
    collator writes them; samples never cross rows) run as one row of `B·T` tokens."""
    from mmfsdp.model.context_parallel import CP_CONTEXT_KEY

    original = module.forward

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None or kwargs.get("cache_params") is not None:
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        cu_seq_lens, cp = kwargs.get("cu_seq_lens_q"), kwargs.get(CP_CONTEXT_KEY)
        if cu_seq_lens is None or cp is not None:
            return gated_deltanet_forward(module, hidden_states, cu_seq_lens, cp)
        B, T, D = hidden_states.shape
        out = gated_deltanet_forward(module, hidden_states.reshape(1, B * T, D), cu_seq_lens)
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
