"""Preference losses (DPO and its variants) on per-sequence log-probabilities, with TRL's definitions.

A preference micro-batch holds pairs as consecutive sequences: chosen_0, rejected_0, chosen_1, rejected_1, ...
The training forward with `sequence_ids` returns each sequence's summed cross-entropy over its trained tokens
(`mmfsdp.model.training_forward`, step 7), so its log-probability is `logp = -loss[k]`. With the reference's
log-probabilities of the same sequences (`ref`), for each pair

    chosen_logratio   = logp_c - ref_c            rewards/chosen   = β · chosen_logratio
    rejected_logratio = logp_r - ref_r            rewards/rejected = β · rejected_logratio
    δ = chosen_logratio - rejected_logratio       rewards/margins  = β · δ,  rewards/accuracies = [β·δ > 0]

and the pair's loss (TRL `DPOTrainer`, `trl==1.16`, `loss_type`):

- `sigmoid`       −(1 − ε) · log σ(β δ) − ε · log σ(−β δ)   (ε = `label_smoothing`; ε = 0 is TRL's `sigmoid`,
                  ε > 0 the conservative DPO of earlier TRL releases)
- `robust`        (−(1 − ε) · log σ(β δ) + ε · log σ(−β δ)) / (1 − 2ε)      (TRL `robust`)
- `hinge`         max(0, 1 − β δ)
- `ipo`           (δ̄ − 1 / (2β))²  with δ̄ = chosen_logratio / n_c − rejected_logratio / n_r (n: the sequence's
                  trained tokens; TRL's length-normalised IPO)
- `sigmoid_norm`  −log σ(β δ̄)  (the length-normalised DPO)

The step objective is the mean of the pair losses over the global batch's pairs, plus `rpo_alpha` times the
mean cross-entropy per chosen token of the global batch (TRL's `sft` loss term, `loss_type=["sigmoid", "sft"]`,
`loss_weights=[1, rpo_alpha]`; the RPO paper's NLL term). Each rank adds its pairs' losses divided by the global
pair count, and its chosen tokens' cross-entropy divided by the global chosen-token count (`pair_objective`),
so the sum over ranks and micro-batches is the global objective, as for the SFT loss (`mmfsdp.model.loss`).
TRL's `DPOTrainer` takes both means per micro-batch and device and averages those: the same for one micro-batch on
one process (`tests/test_dpo_trl.py` checks loss, statistics and gradients against it there), not when micro-batches
hold different numbers of pairs or chosen tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mmfsdp.model.loss import loss_dtype

__all__ = ["PreferenceLossType", "PREFERENCE_LOSS_TYPES", "PairTerms", "pair_losses", "pair_objective", "PAIR_STATS"]

PreferenceLossType = Literal["sigmoid", "robust", "hinge", "ipo", "sigmoid_norm"]
PREFERENCE_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "robust", "hinge", "ipo", "sigmoid_norm")

PAIR_STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
              "logps/rejected")
"""The per-pair statistics averaged over a step's pairs, named as TRL names them."""


@dataclass(slots=True)
class PairTerms:
    """One micro-batch's pairs: per-pair losses and the statistics' per-pair values (`PAIR_STATS` order)."""

    losses: torch.Tensor
    """`[P]` fp32 (fp64 for fp64 log-probabilities), differentiable."""
    stats: torch.Tensor
    """`[len(PAIR_STATS), P]` in the losses' dtype, detached."""


def pair_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    num_tokens: torch.Tensor,
    *,
    loss_type: PreferenceLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PairTerms:
    """The pair losses of `2P` sequences in pair order (`[chosen_0, rejected_0, ...]`): the policy's log-probabilities
    `logps`, the reference's `ref_logps` and each sequence's trained-token count `num_tokens` (module docstring)."""
    if logps.shape[0] % 2:
        raise ValueError(f"{logps.shape[0]} sequences are not whole pairs")
    logps = logps.to(loss_dtype(logps.dtype))
    ref_logps = ref_logps.to(logps.device, logps.dtype)
    chosen, rejected = logps[0::2], logps[1::2]
    chosen_ratio = chosen - ref_logps[0::2]
    rejected_ratio = rejected - ref_logps[1::2]
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type in ("ipo", "sigmoid_norm"):
        counts = num_tokens.to(logps.device, logps.dtype).clamp(min=1.0)
        normalised = chosen_ratio / counts[0::2] - rejected_ratio / counts[1::2]
        if loss_type == "ipo":
            losses = (normalised - 1 / (2 * beta)) ** 2
        else:
            losses = -F.logsigmoid(beta * normalised)
    else:
        raise ValueError(f"unknown preference loss_type {loss_type!r}; expected one of {', '.join(PREFERENCE_LOSS_TYPES)}")
    with torch.no_grad():
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        margins = chosen_rewards - rejected_rewards
        stats = torch.stack([chosen_rewards, rejected_rewards, margins, (chosen_rewards > rejected_rewards).to(logps.dtype),
                             chosen, rejected])
    return PairTerms(losses=losses, stats=stats.detach())


def pair_objective(
    sequence_ce: torch.Tensor,
    ref_logps: torch.Tensor,
    num_tokens: torch.Tensor,
    *,
    num_pairs_global: torch.Tensor | float,
    num_chosen_tokens_global: torch.Tensor | float,
    loss_type: PreferenceLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 0.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PairTerms]:
    """This micro-batch's share of the step objective (module docstring) from the policy's per-sequence summed
    cross-entropy `sequence_ce` (`[2P]`, the training forward's `.loss`), and its `PairTerms`. `valid` (bool `[P]`)
    marks the pairs that count: a filler pair (no trained token; a token-budget step's padding) adds nothing to the
    loss or the statistics."""
    terms = pair_losses(-sequence_ce, ref_logps, num_tokens, loss_type=loss_type, beta=beta,
                        label_smoothing=label_smoothing)
    if valid is not None:
        keep = valid.to(device=terms.losses.device, dtype=torch.bool)
        terms = PairTerms(losses=torch.where(keep, terms.losses, 0.0), stats=torch.where(keep, terms.stats, 0.0))
    dtype = terms.losses.dtype
    pairs = torch.as_tensor(num_pairs_global, device=sequence_ce.device).to(dtype).clamp(min=1.0)
    loss = terms.losses.sum() / pairs
    if rpo_alpha:
        chosen_tokens = torch.as_tensor(num_chosen_tokens_global, device=sequence_ce.device).to(dtype)
        loss = loss + rpo_alpha * sequence_ce[0::2].sum() / chosen_tokens.clamp(min=1.0)
    return loss, terms
