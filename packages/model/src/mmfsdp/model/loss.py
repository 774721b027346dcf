"""Targets, per-token loss weights with global normalisers, and the weighted cross-entropy.

The model's training loss for one micro-batch on one rank is

    loss = Σ_t w_t · CE(logits_t, y_t)          (fp32; tokens with y_t = -100 add 0)

where `y = shift_labels(labels)` is the next-token target of every position and
`w = compute_loss_weights(...)` holds the normalisation. The weights of a step
are computed once, before any forward, from the targets of all `M` micro-batches
of the step, with the counts summed over the `D` ranks of the data-parallel
group, so that the sum of `loss` over the step's micro-batches and ranks is the
step's objective, independent of how the global batch is split:

- `default`    — mean over all trained tokens of the global batch:
                 w_t = 1 / N,   N = Σ_{micro-batches, dp ranks} #{t : y_t ≠ -100}
- `per_sample` — mean over samples of each sample's mean token loss:
                 w_t = 1 / (S · n_s(t)),   n_s = trained tokens of sample s,
                 S = number of samples with n_s > 0 in the global batch
                 (a sample is a batch row, or a packed sequence of the
                 micro-batch's `cu_seq_lens`)
- `per_token`  — MindSpeed-MM's `per_token_loss`: each micro-batch's token sum is
                 divided by N̄ = N / (M · D), the average trained-token count of one
                 micro-batch on one rank in this step (MindSpeed-MM all-reduces it
                 with AVG over the dp group); its trainer then divides by M before
                 backward and averages the logged loss and the gradients over the D
                 ranks. Here the trainer sums over micro-batches and ranks, so the
                 weight carries that 1 / (M · D):
                 w_t = 1 / (M · D · N̄) = 1 / N
                 The step objective is Σ CE / N whatever M and D are: the same
                 number on 1 process and on N, and the same value as `default`
                 (which here is already the global token mean; MindSpeed-MM's own
                 `default` is a per-micro-batch mean, which mmfsdp does not offer)

When the normaliser is 0 (no trained token anywhere) every weight is 0, so the
loss and gradients are 0, not NaN.

Gradients: FSDP2 averages gradients over its shard group, so the trainer
backpropagates `loss × fsdp_group_size` to turn that average into the sum over
ranks. Under context parallel the weights are computed on the full sequences
(before the split, with the dp group, which excludes CP), each CP rank sums
its shard's `w_t · CE_t`, and the shard losses add up to the sample's loss.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "sample_starts",
    "sample_ids",
    "shift_labels",
    "compute_loss_weights",
    "weighted_cross_entropy",
    "sequence_cross_entropy",
    "token_cross_entropy",
    "segment_sum",
    "LossType",
]

IGNORE_INDEX = -100
LossType = Literal["default", "per_sample", "per_token"]


def sample_starts(shape: torch.Size | tuple[int, ...], cu_seq_lens: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean `[B, S]`: True where a sample starts — every row's first token, and with packing every
    start in `cu_seq_lens` (cumulative lengths over the flattened `B·S` tokens, leading 0 included).

    Boundaries are data: they come from `cu_seq_lens`, never from position values (M-RoPE
    positions are `[3, B, S]` and do not restart at 0 per sample).
    """
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    if cu_seq_lens is not None:
        flat = starts.view(-1)
        cu = cu_seq_lens.reshape(-1).to(device=flat.device, dtype=torch.int64)
        flat[cu[cu < flat.numel()]] = True
    starts[..., 0] = True
    return starts


def shift_labels(labels: torch.Tensor, cu_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets: `out[b, t] = labels[b, t + 1]`, -100 at the last position.

    With packed rows (`cu_seq_lens` over the flattened `B·S` tokens), the last
    token of every sample gets -100 too, so no sample predicts the next one's first token.
    """
    out = torch.full_like(labels, IGNORE_INDEX)
    out[..., :-1] = labels[..., 1:]
    if cu_seq_lens is not None:
        out[..., :-1].masked_fill_(sample_starts(labels.shape, cu_seq_lens, labels.device)[..., 1:], IGNORE_INDEX)
    return out


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses are computed in for inputs of `dtype`: fp32 for fp32 and narrower, fp64 for fp64 (a fp64
    reference run stays fp64 end to end)."""
    return torch.promote_types(dtype, torch.float32)


def _per_token_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(loss_dtype(logits.dtype)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    )


def weighted_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor, loss_weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t · CE(logits_t, y_t) in fp32 (fp64 for fp64 logits) over all positions; targets -100 contribute 0."""
    per_token = _per_token_cross_entropy(logits, shift_labels)
    return (per_token * loss_weights.reshape(-1).to(per_token.dtype)).sum()


def sample_ids(shape: torch.Size | tuple[int, ...], cu_seq_lens: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """int64 `[B, S]`: the index of the sample each token belongs to, counted in row-major order from 0 — the
    row without packing, the `cu_seq_lens` segment with it (a trailing padding segment is a sample too)."""
    return sample_starts(shape, cu_seq_lens, device).reshape(-1).cumsum(0).reshape(shape) - 1


def sequence_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, loss_weights: torch.Tensor, sequence_ids: torch.Tensor,
    num_sequences: int,
) -> torch.Tensor:
    """fp32 (fp64 for fp64 logits) `[num_sequences]`: `out[k] = Σ_{t : sequence_ids[t] = k} w_t · CE(logits_t, y_t)`; tokens with target
    -100 or a negative sequence id add nothing. With `w_t = 1` on the trained tokens, `-out[k]` is the log-probability
    of sequence k's trained tokens (what preference losses compare)."""
    per_token = _per_token_cross_entropy(logits, shift_labels)
    return segment_sum(per_token * loss_weights.reshape(-1).to(per_token.dtype), sequence_ids, num_sequences)


def token_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, loss_weights: torch.Tensor, temperature: float = 1.0,
    suppress_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per token, `[B, S]` fp32 (fp64 for fp64 logits): `w_t · CE(logits_t / T, y_t)` (targets -100 add 0; with
    `w_t = 1` on the completion tokens, minus it is each token's log-probability under the policy sampled at
    temperature T over the whole vocabulary, TRL's `selective_log_softmax(logits / T)`), the detached entropy of
    `softmax(logits_t / T)` (TRL's `entropy_from_logits`; online RL's `entropy` statistic) and, given the tokens a
    sampler never draws (`suppress_token_ids`, `mmfsdp.model.rollout.SamplingParams`), the detached log of the
    mass of the others, `log Σ_{v ∉ suppressed} softmax(logits_t / T)_v`: minus it, added to a token's
    log-probability, gives its log-probability under the sampler's distribution (None without them)."""
    scaled = logits.to(loss_dtype(logits.dtype)) / temperature
    per_token = _per_token_cross_entropy(scaled, shift_labels) * loss_weights.reshape(-1).to(scaled.dtype)
    kept = None
    with torch.no_grad():
        logps = scaled.detach().log_softmax(dim=-1)
        entropy = -torch.where(logps > float("-inf"), logps.exp() * logps, 0.0).sum(dim=-1)
        if suppress_token_ids is not None and suppress_token_ids.numel():
            dropped = logps.index_select(-1, suppress_token_ids.to(logps.device)).logsumexp(dim=-1)
            kept = torch.log1p(-dropped.exp()).reshape(shift_labels.shape)
    return per_token.reshape(shift_labels.shape), entropy.reshape(shift_labels.shape), kept


def segment_sum(values: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """`out[k] = Σ_{t : sequence_ids[t] = k} values[t]` over the flattened tensors; negative ids are dropped."""
    ids = sequence_ids.reshape(-1).to(values.device)
    keep = ids >= 0
    out = torch.zeros(num_sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, ids.clamp(min=0), torch.where(keep, values.reshape(-1), 0))


def _all_reduce_sum(values: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return values
    device = torch.device("cpu")
    if "gloo" not in str(dist.get_backend(group)):
        device = torch.accelerator.current_accelerator()
    reduced = values.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return reduced.to(values.device)


def compute_loss_weights(
    shift_labels: Sequence[torch.Tensor],
    *,
    loss_type: LossType = "default",
    cu_seq_lens: Sequence[torch.Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
    num_micro_batches: int | None = None,
) -> list[torch.Tensor]:
    """The fp32 per-token loss weights of every micro-batch of one step (formulas in the module docstring).

    `shift_labels` holds the targets of all micro-batches of the step on this
    rank; `cu_seq_lens` (one per micro-batch, or None: one sample per row) marks
    packed samples for `per_sample`; `group` is the data-parallel group over which counts are summed
    (None: this process alone). Every rank of `group` must call this with the
    same number of micro-batches. The weights are on the targets' device; for `default` and `per_token`
    the host never waits for the device (the normaliser stays a tensor), `per_sample` reads its sample
    count on the host.
    """
    num_micro = len(shift_labels)
    if num_micro_batches is not None and num_micro_batches != num_micro:
        raise ValueError(f"num_micro_batches={num_micro_batches} but {num_micro} micro-batches of targets were given")
    if cu_seq_lens is None:
        cu_seq_lens = [None] * num_micro
    if len(cu_seq_lens) != num_micro:
        raise ValueError(f"{len(cu_seq_lens)} cu_seq_lens for {num_micro} micro-batches")
    trained = [targets != IGNORE_INDEX for targets in shift_labels]
    device = shift_labels[0].device if num_micro else torch.device("cpu")

    if loss_type in ("default", "per_token"):
        local = torch.stack([mask.sum() for mask in trained]).sum() if num_micro else torch.zeros((), dtype=torch.int64)
        # N stays a tensor on the targets' device: with the targets on the accelerator nothing waits for it
        num_trained = _all_reduce_sum(local.to(torch.int64).reshape(1), group).reshape(()).to(torch.float64)
        # per_token: 1 / (M · D · N̄) with N̄ = N / (M · D), i.e. 1 / N (module docstring); 0 when N is 0
        weight = torch.where(num_trained > 0, 1.0 / num_trained.clamp(min=1), 0.0).to(torch.float32)
        return [mask.to(torch.float32) * weight.to(mask.device) for mask in trained]

    if loss_type != "per_sample":
        raise ValueError(f"unknown loss_type {loss_type!r}; expected default, per_sample or per_token")
    # per-sample counts on the host (sample ids and their bincount), the weights then moved to the targets' device
    trained = [mask.cpu() for mask in trained]
    per_sample_counts = []
    local_samples = torch.zeros((), dtype=torch.int64)
    for mask, cu in zip(trained, cu_seq_lens):
        ids = sample_ids(mask.shape, cu, mask.device)
        counts = torch.bincount(ids.reshape(-1), weights=mask.reshape(-1).to(torch.float64), minlength=int(ids.max()) + 1)
        per_sample_counts.append((ids, counts))
        local_samples += (counts > 0).sum()
    num_samples = int(_all_reduce_sum(local_samples.reshape(1), group).item())
    weights = []
    for mask, (ids, counts) in zip(trained, per_sample_counts):
        if num_samples == 0:
            weights.append(torch.zeros(mask.shape, dtype=torch.float32, device=device))
            continue
        token_counts = counts[ids]
        per_token = torch.where(mask, 1.0 / (token_counts.clamp(min=1) * num_samples), 0.0)
        weights.append(per_token.to(device=device, dtype=torch.float32))
    return weights
