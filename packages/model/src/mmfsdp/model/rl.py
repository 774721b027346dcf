"""Online RL (the GRPO family) on per-token log-probabilities, with TRL's definitions (`GRPOTrainer`, `trl==1.16`).

A rollout gives `B` completions in groups of `G = num_generations` (one prompt each), their rewards and, per
completion token t of sequence b, the log-probabilities of the sampled token under the policy being trained
(`logp`), the policy that sampled it or the previous iteration's (`old`; None = the detached current policy, TRL's
shortcut for `num_iterations = 1`) and the frozen reference (`ref`, when β > 0). `mask[b, t]` marks the trained
completion tokens.

Advantages (`group_advantages`; TRL `_generate_and_score_completions`, `multi_objective_aggregation:
sum_then_normalize`), with r the weighted sum of the reward functions:

    A_b = (r_b − mean_group(r)) / (std + 1e-4)     std: Bessel-corrected, of the group (`scale_rewards: group`)
                                                   or of the whole batch (`batch`); `none`: A_b = r_b − mean_group(r)

Per-token loss (`policy_terms`), ε_low = `epsilon`, ε_high = `epsilon_high` (DAPO's clip-higher; default ε_low):

    log ρ_bt = logp_bt − old_bt                                (`importance_sampling_level: token`)
    log ρ_b  = Σ_t m_bt (logp_bt − old_bt) / max(n_b, 1)       (`sequence`, GSPO: one ratio per sequence, broadcast)
    ρ̂ = clamp(ρ, 1 − ε_low, 1 + ε_high);   ρ̃ = min(ρ, δ) with `delta` (INTELLECT-2's two-sided clipping), else ρ
    ℓ_bt = −min(ρ̃ A_b, ρ̂ A_b) + β · KL_bt
    KL_bt = exp(ref − logp) − (ref − logp) − 1                 (the k3 estimator; × ρ with `kl_bias_correction`,
                                                                TRL's `use_bias_correction_kl`, on by default)

Aggregation (`policy_objective`, `loss_type`), over the trained tokens; n_b = Σ_t m_bt:

- `grpo`     mean over sequences of each sequence's token mean: Σ_b (Σ_t m ℓ / max(n_b, 1)) / S
- `bnpo`     the micro-batch's token mean Σ m ℓ / max(Σ m, 1), averaged over the step's micro-batches and ranks
- `dr_grpo`  Σ m ℓ / (S · max_completion_length)
- `dapo`     Σ m ℓ / N, the token mean over the global batch

with S the global batch's sequences and N its trained tokens. As for the SFT loss (`mmfsdp.model.loss`, the
"loss × world size" paragraph) and DPO (`mmfsdp.model.preference`), `policy_objective` returns one micro-batch's
*share*: the normaliser is global (`num_sequences_global`, `num_tokens_global`, `num_batches_global` = micro-batches
× data-parallel ranks of the step), so that the sum of the shares over the step's micro-batches and ranks is the
step's objective; the trainer backpropagates share × fsdp group size because FSDP2 averages gradients.

TRL computes each `grpo`, `bnpo`, `dr_grpo` loss per micro-batch (divided by its gradient-accumulation steps) and
DDP averages over ranks: the same objective when every micro-batch holds the same number of sequences (TRL's
`per_device_train_batch_size`); for `grpo` and `dr_grpo` we take the global sequence mean when they do not.
TRL's `dapo` loss on one rank is Σ m ℓ / (N / world size): our share × world size.

Statistics, named as TRL logs them from `_compute_loss`: `kl` (β > 0) and `entropy` (given per-token entropies) are
token means; `clip_ratio/low_mean` (ρ̃ < 1 − ε_low and A < 0), `clip_ratio/high_mean` (ρ̃ > 1 + ε_high and A > 0)
and `clip_ratio/region_mean` (either) are token means, or means over all sequences (empty ones included) at sequence
level; `clip_ratio/low_min` and `clip_ratio/high_max` are the minimum and maximum over sequences of each sequence's
clipped fraction (sequences without a trained token left out). `PolicyTerms` carries them as detached sums and
counts and per-micro-batch extremes, for an all-reduce (SUM; MIN and MAX) before `policy_stats` divides.

Rollout/trainer mismatch (`sampling_correction`, TRL's `vllm_importance_sampling_correction`; verl's TIS): the
engine samples from its own numerics, μ, not from the old policy. With the engine's sampling log-probabilities `eng`
(`mode`, TRL's `vllm_importance_sampling_mode`; C_min, C_max its `_clip_min`, `_clip_max`):

    log w_bt = m_bt (old_bt − eng_bt)                 (`token_*`; NaN engine log-probs give 0)
    log w_b  = Σ_t m_bt (old_bt − eng_bt)             (`sequence_*`: a sum, not GSPO's mean; one weight, broadcast)
    w ← clamp(w, C_min, C_max)                        (`*_truncate`: TIS)
    w ← 0 where w < C_min or w > C_max                (`*_mask`: MIS)
    ℓ_bt = −w · min(ρ̃ A_b, ρ̂ A_b) + β · KL_bt         (the KL term is not weighted; nor are the clip statistics)

w is detached (no gradient); `sampling/importance_sampling_ratio/mean` is its mean over the trained tokens (token
modes) or over every sequence (sequence modes, empty ones included, as TRL's), `/min` and `/max` its extremes there.

DAPO's helpers: `truncated_completions` / `mask_truncated` (TRL's `mask_truncated_completions`: a completion that
does not end in a stop or pad token was cut at the length limit and trains nothing) and `zero_std_groups` (the
groups whose rewards are all equal: their advantages are 0; DAPO's dynamic sampling drops them and samples more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch

from mmfsdp.model.loss import loss_dtype

__all__ = [
    "RLLossType",
    "RL_LOSS_TYPES",
    "ScaleRewards",
    "SCALE_REWARDS",
    "ImportanceSamplingLevel",
    "SamplingCorrectionMode",
    "SAMPLING_CORRECTION_MODES",
    "SAMPLING_RATIO_MEAN",
    "sampling_correction",
    "sequence_mean_stats",
    "POLICY_EXTREME_STATS",
    "PolicyTerms",
    "group_advantages",
    "zero_std_groups",
    "truncated_completions",
    "mask_truncated",
    "policy_terms",
    "policy_objective",
    "policy_stats",
]

RLLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
RL_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
ImportanceSamplingLevel = Literal["token", "sequence"]
SamplingCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLING_CORRECTION_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SAMPLING_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"

STD_EPSILON = 1e-4
"""Added to the reward std before dividing (TRL's constant)."""
POLICY_EXTREME_STATS = ("clip_ratio/low_min", "clip_ratio/high_max",
                        "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")
"""The extreme statistics (`PolicyTerms.extremes`), in that order: even positions reduced with MIN, odd with MAX."""


def _bessel_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's `nanstd` without NaNs: sqrt(mean((x − mean)²) · n / (n − 1)), the same fp32 rounding."""
    count = values.numel() if dim is None else values.shape[dim]
    mean = values.mean() if dim is None else values.mean(dim=dim, keepdim=True)
    variance = ((values - mean) ** 2).mean() if dim is None else ((values - mean) ** 2).mean(dim=dim)
    return (variance * (count / (count - 1))).sqrt()


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one value per completion, got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of num_generations={num_generations}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, num_generations)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: ScaleRewards = "group"
) -> torch.Tensor:
    """`[B]` advantages of `B` rewards in consecutive groups of `num_generations` (module docstring). For `batch`
    the std is over the rewards given: pass the whole generation batch (every rank's groups) to match TRL."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(SCALE_REWARDS)}")
    grouped = _grouped(rewards, num_generations)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = _bessel_std(grouped, dim=1) if num_generations > 1 else torch.zeros(grouped.shape[0])
        std = std.to(grouped).repeat_interleave(num_generations)
    else:
        std = _bessel_std(grouped.reshape(-1)) if grouped.numel() > 1 else torch.zeros((), dtype=grouped.dtype)
    return centred / (std + STD_EPSILON)


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Bool `[B / num_generations]`: True for a group whose rewards have zero std (all equal, so all advantages are
    zero; TRL's `frac_reward_zero_std` counts them). DAPO's dynamic sampling keeps only the others."""
    grouped = _grouped(rewards, num_generations)
    if num_generations == 1:
        return torch.ones(grouped.shape[0], dtype=torch.bool)
    std = _bessel_std(grouped, dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def sampling_correction(
    old_logps: torch.Tensor,
    engine_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: SamplingCorrectionMode = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """The detached importance weights w (module docstring) of completions `[B, T]` sampled by an engine with
    log-probabilities `engine_logps` under the old policy's `old_logps`: `[B, T]` in token modes, `[B, 1]` in
    sequence modes (TRL's defaults: `sequence_mask`, C_max 3, no C_min)."""
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"unknown sampling correction mode {mode!r}; expected one of "
                         f"{', '.join(SAMPLING_CORRECTION_MODES)}")
    with torch.no_grad():
        mask = mask.to(old_logps.dtype)
        log_weights = torch.nan_to_num((old_logps - engine_logps.to(old_logps)) * mask, nan=0.0)
        if mode.startswith("sequence"):
            log_weights = log_weights.sum(dim=1, keepdim=True)
        weights = torch.exp(log_weights)
        if mode.endswith("truncate"):
            return weights if clip_min is None and clip_max is None else weights.clamp(min=clip_min, max=clip_max)
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return weights.masked_fill((weights < low) | (weights > high), 0.0)


def sequence_mean_stats(
    importance_sampling_level: ImportanceSamplingLevel, sampling_mode: SamplingCorrectionMode | None = None
) -> frozenset[str]:
    """The mean statistics of `PolicyTerms` that are means over sequences (every sequence counts), not over the
    trained tokens: the clip ratios at sequence level, the sampling correction's mean in its sequence modes."""
    names = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    out = set(names) if importance_sampling_level == "sequence" else set()
    if sampling_mode is not None and sampling_mode.startswith("sequence"):
        out.add(SAMPLING_RATIO_MEAN)
    return frozenset(out)


def truncated_completions(completion_ids: Sequence[Sequence[int]], stop_token_ids: Iterable[int]) -> torch.Tensor:
    """Bool `[B]`: True for a completion whose last token is not one of `stop_token_ids` (eos and pad ids): the
    rollout cut it at the length limit. An empty completion is not truncated (it has no token to mask)."""
    stops = set(stop_token_ids)
    return torch.tensor([len(ids) > 0 and int(ids[-1]) not in stops for ids in completion_ids], dtype=torch.bool)


def mask_truncated(completion_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """`completion_mask` `[B, T]` with the rows of truncated completions zeroed (DAPO's overlong filtering)."""
    keep = (~truncated.to(device=completion_mask.device, dtype=torch.bool)).unsqueeze(1)
    return completion_mask * keep.to(completion_mask.dtype)


@dataclass(slots=True)
class PolicyTerms:
    """One micro-batch's per-token loss terms and its statistics in all-reducible form."""

    token_losses: torch.Tensor
    """`[B, T]` ℓ_bt, zero off the mask; differentiable."""
    names: tuple[str, ...]
    """The mean statistics present: `kl` (β > 0), `entropy` (entropies given), the three `clip_ratio/*_mean`,
    `sampling/importance_sampling_ratio/mean` (with a sampling correction)."""
    sums: torch.Tensor
    """`[len(names)]` detached: each statistic's sum over this micro-batch's tokens (or sequences)."""
    counts: torch.Tensor
    """`[len(names)]` detached: what each sum is over (trained tokens, or sequences at sequence level)."""
    extremes: torch.Tensor
    """`[4]` detached (`POLICY_EXTREME_STATS`): the smallest per-sequence low-clipped fraction and the largest
    high-clipped fraction, +inf / −inf when no sequence has a trained token; the smallest and largest sampling
    correction weight, +inf / −inf without one (or with nothing to average)."""


def policy_terms(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    kl_bias_correction: bool = True,
    engine_logps: torch.Tensor | None = None,
    sampling_correction_mode: SamplingCorrectionMode | None = None,
    sampling_clip_min: float | None = None,
    sampling_clip_max: float | None = 3.0,
) -> PolicyTerms:
    """The per-token losses ℓ and statistics (module docstring) of completions `[B, T]`: the policy's per-token
    log-probabilities `logps`, `advantages` (`[B]`, or `[B, T]` per token), the trained-token `mask`, and optionally
    the sampling / previous iteration's `old_logps`, the reference's `ref_logps` (required for `beta > 0`) and the
    policy's per-token `entropies` (for the `entropy` statistic). With `sampling_correction_mode` the policy term is
    weighted by `sampling_correction(old, engine_logps, mask, mode, sampling_clip_min, sampling_clip_max)`."""
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; expected token or sequence")
    if sampling_correction_mode is not None and engine_logps is None:
        raise ValueError("a sampling correction needs the engine's per-token log-probabilities (engine_logps)")
    if beta and ref_logps is None:
        raise ValueError(f"beta={beta} needs the reference's per-token log-probabilities (ref_logps)")
    dtype = loss_dtype(logps.dtype)
    logps = logps.to(dtype)
    like = {"device": logps.device, "dtype": dtype}
    mask = mask.to(**like)
    old_logps = logps.detach() if old_logps is None else old_logps.to(**like)
    advantages = advantages.to(**like)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    epsilon_low, epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    num_tokens = mask.sum(dim=1)

    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(dim=1) / num_tokens.clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_weights)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    losses = -torch.min(capped * advantages, clipped * advantages)
    weights = None
    if sampling_correction_mode is not None:
        weights = sampling_correction(old_logps, engine_logps, mask, sampling_correction_mode, sampling_clip_min,
                                      sampling_clip_max)
        losses = losses * weights
    if beta:
        ref_gap = ref_logps.to(**like) - logps
        kl = torch.exp(ref_gap) - ref_gap - 1
        if kl_bias_correction:
            kl = kl * ratio
        losses = losses + beta * kl
    token_losses = losses.expand_as(mask) * mask

    with torch.no_grad():
        names, sums, counts = [], [], []

        def token_mean(name: str, values: torch.Tensor) -> None:
            names.append(name)
            sums.append((values.expand_as(mask) * mask).sum())
            counts.append(mask.sum())

        if beta:
            token_mean("kl", kl)
        if entropies is not None:
            token_mean("entropy", entropies.to(**like))
        per_sequence = importance_sampling_level == "sequence" and advantages.shape[1] == 1
        low = ((capped < 1 - epsilon_low) & (advantages < 0)).to(dtype)
        high = ((capped > 1 + epsilon_high) & (advantages > 0)).to(dtype)
        region = torch.maximum(low, high)
        for name, values in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                             ("clip_ratio/region_mean", region)):
            if per_sequence:  # one value per sequence, and every sequence counts (TRL's)
                names.append(name)
                sums.append(values.sum())
                counts.append(torch.tensor(float(values.shape[0]), **like))
            else:
                token_mean(name, values)
        if per_sequence:
            low_per_sequence, high_per_sequence = low[:, 0], high[:, 0]
            present = torch.ones_like(low_per_sequence, dtype=torch.bool)
        else:
            low_per_sequence = (low.expand_as(mask) * mask).sum(dim=1) / num_tokens.clamp(min=1.0)
            high_per_sequence = (high.expand_as(mask) * mask).sum(dim=1) / num_tokens.clamp(min=1.0)
            present = num_tokens > 0
        inf = torch.tensor(float("inf"), **like)
        weight_min, weight_max = inf, -inf
        if weights is not None:
            names.append(SAMPLING_RATIO_MEAN)
            if sampling_correction_mode.startswith("sequence"):  # every sequence counts (TRL's)
                counted = torch.ones_like(weights, dtype=torch.bool)
            else:
                counted = mask.bool()
            sums.append(torch.where(counted, weights, 0.0).sum())
            counts.append(counted.sum().to(dtype))
            if counted.numel():
                weight_min = torch.where(counted, weights, inf).min()
                weight_max = torch.where(counted, weights, -inf).max()
        extremes = torch.stack([
            torch.where(present, low_per_sequence, inf).min() if present.numel() else inf,
            torch.where(present, high_per_sequence, -inf).max() if present.numel() else -inf,
            weight_min, weight_max,
        ])
    return PolicyTerms(
        token_losses=token_losses, names=tuple(names), sums=torch.stack(sums), counts=torch.stack(counts),
        extremes=extremes,
    )


def policy_objective(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: RLLossType = "dapo",
    num_sequences_global: torch.Tensor | float | None = None,
    num_tokens_global: torch.Tensor | float | None = None,
    num_batches_global: int = 1,
    max_completion_length: int | None = None,
    **terms,
) -> tuple[torch.Tensor, PolicyTerms]:
    """This micro-batch's share of the step objective (module docstring) and its `PolicyTerms`; `terms` are
    `policy_terms`'s keywords. The normaliser each `loss_type` needs is required: `num_sequences_global` (`grpo`,
    `dr_grpo`), `max_completion_length` (`dr_grpo`), `num_tokens_global` (`dapo`), `num_batches_global` (`bnpo`)."""
    if loss_type not in RL_LOSS_TYPES:
        raise ValueError(f"unknown RL loss_type {loss_type!r}; expected one of {', '.join(RL_LOSS_TYPES)}")
    needs = {"grpo": ("num_sequences_global",), "dr_grpo": ("num_sequences_global", "max_completion_length"),
             "dapo": ("num_tokens_global",), "bnpo": ()}[loss_type]
    given = {"num_sequences_global": num_sequences_global, "num_tokens_global": num_tokens_global,
             "max_completion_length": max_completion_length}
    missing = [name for name in needs if given[name] is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {' and '.join(missing)}")
    if num_batches_global < 1:
        raise ValueError(f"num_batches_global must be at least 1, got {num_batches_global}")
    out = policy_terms(logps, advantages, mask, **terms)
    token_losses = out.token_losses
    device, dtype = token_losses.device, token_losses.dtype

    def count(value) -> torch.Tensor:
        return torch.as_tensor(value, device=device).to(dtype).clamp(min=1.0)

    if loss_type == "grpo":
        sequence_means = token_losses.sum(dim=1) / mask.to(dtype).sum(dim=1).clamp(min=1.0)
        loss = sequence_means.sum() / count(num_sequences_global)
    elif loss_type == "bnpo":
        loss = token_losses.sum() / mask.to(dtype).sum().clamp(min=1.0) / num_batches_global
    elif loss_type == "dr_grpo":
        loss = token_losses.sum() / (count(num_sequences_global) * max_completion_length)
    else:
        loss = token_losses.sum() / count(num_tokens_global)
    return loss, out


def policy_stats(
    names: tuple[str, ...], sums: torch.Tensor, counts: torch.Tensor, extremes: torch.Tensor
) -> dict[str, float]:
    """The logged statistics from `PolicyTerms` fields summed over micro-batches and ranks (`sums`, `counts`) and
    reduced with MIN / MAX (`extremes`): means (a zero count gives 0, as TRL's), and the extremes (NaN when no
    sequence had a trained token, as TRL's `nanmin` / `nanmax`); the sampling correction's extremes only with its
    mean. Reads the values to the host."""
    means = (sums / counts.clamp(min=1.0)).tolist()
    extreme = dict(zip(POLICY_EXTREME_STATS,
                       (value if abs(value) != float("inf") else float("nan") for value in extremes.tolist())))
    if SAMPLING_RATIO_MEAN not in names:
        extreme = dict(list(extreme.items())[:2])
    return {**dict(zip(names, means)), **extreme}
