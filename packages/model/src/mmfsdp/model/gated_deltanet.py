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

The kernels (the packed chunked delta rule, the packed causal convolution, the kernel choice) are
`mmfsdp.model.gated_delta_rule`; this module is the layer, its context-parallel paths and its micro-batch plan.

Shape legend: B batch, T tokens, D hidden, Hk key heads, Hv value heads, dk/dv head dims, C conv channels,
K conv kernel, N samples/segments.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmfsdp.model.gated_delta_rule import (
    CHUNK,
    GDN_KERNELS,
    SegmentPlan,
    _compute_dtype,
    _fla_applies,
    _fla_gated_delta_rule,
    chunk_gated_delta_rule_packed,
    packed_causal_conv1d,
    resolve_gdn_kernel,
    upload,
)
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

PLAN_NAME = "gated_deltanet"
"""The name of the Gated DeltaNet's part of a `BatchPlan` (`BatchPlan.layers`)."""


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
    original = type(module).forward

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None or kwargs.get("cache_params") is not None:
            return original(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        cu_seq_lens, cp = kwargs.get("cu_seq_lens_q"), kwargs.get(CP_CONTEXT_KEY)
        batch_plan = kwargs.get(BATCH_PLAN_KEY)
        plan = None if batch_plan is None else batch_plan.layers.get(PLAN_NAME)
        kernel = self.gdn_kernel
        if cu_seq_lens is None or cp is not None:
            return gated_deltanet_forward(self, hidden_states, cu_seq_lens, cp, kernel=kernel, plan=plan)
        B, T, D = hidden_states.shape
        out = gated_deltanet_forward(self, hidden_states.reshape(1, B * T, D), cu_seq_lens, kernel=kernel, plan=plan)
        return out.reshape(B, T, -1)

    # bound to the module, not a closure over it: a deep copy of the model runs its own weights
    module.forward = types.MethodType(forward, module)


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
