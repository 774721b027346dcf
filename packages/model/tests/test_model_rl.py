"""`mmfsdp.model.rl`: advantages, masks, the per-token loss and its aggregation on hand-made cases (TRL's agreement
is `tests/test_grpo_trl.py`)."""

from __future__ import annotations

import math

import pytest
import torch
from mmfsdp.model.rl import (
    group_advantages,
    mask_truncated,
    policy_objective,
    policy_stats,
    policy_terms,
    truncated_completions,
    zero_std_groups,
)


def batch(seed: int = 0, lengths=(4, 2, 0, 3)):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    logps = (-3 * torch.rand(mask.shape, generator=generator)).requires_grad_()
    old = logps.detach() + 0.4 * torch.randn(mask.shape, generator=generator)
    ref = logps.detach() + 0.4 * torch.randn(mask.shape, generator=generator)
    advantages = torch.randn(len(lengths), generator=generator)
    return logps, old, ref, advantages, mask


def test_advantages_of_equal_rewards_are_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    for scale in ("group", "batch", "none"):
        advantages = group_advantages(rewards, 3, scale)
        assert advantages.shape == (6,)
        assert torch.equal(advantages[:3], torch.zeros(3))
    assert zero_std_groups(rewards, 3).tolist() == [True, False]


def test_advantages_scaling():
    rewards = torch.tensor([0.0, 1.0, 2.0, 0.0, 10.0, 20.0])
    centred = torch.tensor([-1.0, 0.0, 1.0, -10.0, 0.0, 10.0])
    assert torch.allclose(group_advantages(rewards, 3, "none"), centred)
    group_std = torch.tensor([1.0, 10.0]).repeat_interleave(3)
    assert torch.allclose(group_advantages(rewards, 3, "group"), centred / (group_std + 1e-4))
    assert torch.allclose(group_advantages(rewards, 3, "batch"), centred / (rewards.std() + 1e-4))
    # one generation per prompt: nothing to compare with, every advantage is 0
    assert torch.equal(group_advantages(rewards, 1, "group"), torch.zeros(6))
    assert zero_std_groups(rewards, 1).all()


@pytest.mark.parametrize(
    ("rewards", "num_generations", "scale", "message"),
    [
        (torch.zeros(5), 2, "group", "not whole groups"),
        (torch.zeros(4), 0, "group", "not whole groups"),
        (torch.zeros(2, 2), 2, "group", "one value per completion"),
        (torch.zeros(4), 2, "std", "unknown scale_rewards"),
    ],
)
def test_advantages_refuse_bad_input(rewards, num_generations, scale, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, num_generations, scale)


def test_truncated_completions_are_masked():
    completions = [[5, 6, 2], [5, 6, 7], [9, 0], [], [4]]
    truncated = truncated_completions(completions, stop_token_ids=[2, 0])
    assert truncated.tolist() == [False, True, False, False, True]
    mask = torch.ones(5, 3, dtype=torch.long)
    assert mask_truncated(mask, truncated).sum(dim=1).tolist() == [3, 0, 3, 3, 0]


def test_padding_and_empty_completions_add_nothing():
    """Values off the mask (padding, an empty completion) change neither the loss nor anything's gradient."""
    logps, old, ref, advantages, mask = batch()
    kwargs = dict(old_logps=old, ref_logps=ref, beta=0.04, num_sequences_global=4, num_tokens_global=9,
                  max_completion_length=6)
    noisy = logps.detach().masked_fill(mask == 0, 7.0).requires_grad_()
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for level in ("token", "sequence"):
            loss, terms = policy_objective(logps, advantages, mask, loss_type=loss_type,
                                           importance_sampling_level=level, **kwargs)
            again, _ = policy_objective(noisy, advantages, mask, loss_type=loss_type, importance_sampling_level=level,
                                        **kwargs)
            assert torch.allclose(loss, again, rtol=1e-6), (loss_type, level)
            (grad,) = torch.autograd.grad(loss, logps)
            assert torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum())))
            assert torch.equal(terms.token_losses[2], torch.zeros(mask.shape[1]))


def test_on_policy_loss_is_minus_the_advantage():
    """num_iterations 1, β = 0: the ratio is 1, each token's loss is −A, its gradient −A."""
    logps, _, _, advantages, mask = batch()
    loss, terms = policy_objective(logps, advantages, mask, loss_type="dapo", num_tokens_global=mask.sum())
    expected = -(advantages * mask.sum(dim=1)).sum() / mask.sum()
    assert torch.allclose(loss, expected)
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.allclose(grad, -advantages[:, None] * mask / mask.sum())
    stats = policy_stats(terms.names, terms.sums, terms.counts, terms.extremes)
    assert stats["clip_ratio/region_mean"] == 0 and "kl" not in stats and "entropy" not in stats


def test_sequence_ratio_is_the_geometric_mean():
    """GSPO: one ratio per sequence, exp of the mean log-ratio over its tokens; clipped per sequence."""
    logps, _, _, _, mask = batch(lengths=(3, 2))
    shift = torch.tensor([[0.1, 0.2, 0.6], [1.0, 0.0, 0.0]])  # mean log-ratios 0.3 and 0.5
    old = logps.detach() - shift
    advantages = torch.tensor([1.0, 1.0])
    loss, terms = policy_objective(logps, advantages, mask, old_logps=old, loss_type="grpo", num_sequences_global=2,
                                   importance_sampling_level="sequence", epsilon=0.2, epsilon_high=0.5)
    # sequence 0: ratio e^0.3 = 1.35 < 1.5, unclipped; sequence 1: e^0.5 = 1.65, clipped at 1.5
    assert torch.allclose(loss, -(math.exp(0.3) + 1.5) / 2 * torch.ones(()))
    stats = policy_stats(terms.names, terms.sums, terms.counts, terms.extremes)
    assert stats["clip_ratio/high_mean"] == 0.5 and stats["clip_ratio/high_max"] == 1.0


def test_two_sided_clipping_caps_negative_advantages():
    """A ratio of 5 on a negative advantage: −A·max(ρ, clip(ρ)) = 5 without δ, δ = 1.3 with it."""
    logps = torch.zeros(1, 1, requires_grad=True)
    old = torch.full((1, 1), -math.log(5.0))
    mask = torch.ones(1, 1)
    for delta, expected in ((None, 5.0), (1.3, 1.3)):
        loss, _ = policy_objective(logps, torch.tensor([-1.0]), mask, old_logps=old, delta=delta, loss_type="bnpo")
        assert torch.allclose(loss, torch.tensor(expected))


def test_shares_add_up_to_the_global_objective():
    """Two micro-batches' shares with the global normalisers sum to the objective of the whole batch."""
    logps, old, ref, advantages, mask = batch(lengths=(4, 2, 0, 3, 1, 4))
    common = dict(old_logps=old, ref_logps=ref, beta=0.04, max_completion_length=5)
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        glob = dict(num_sequences_global=6, num_tokens_global=mask.sum(), loss_type=loss_type, **common)
        whole, _ = policy_objective(logps, advantages, mask, **glob)
        parts = [
            policy_objective(logps[rows], advantages[rows], mask[rows], **{**glob, "old_logps": old[rows],
                                                                             "ref_logps": ref[rows]})[0]
            for rows in (slice(0, 2), slice(2, 6))
        ]
        assert torch.allclose(sum(parts), whole), loss_type
    # bnpo: the mean of the micro-batches' token means
    halves = (slice(0, 3), slice(3, 6))
    means, shares = [], []
    for rows in halves:
        part = dict(loss_type="bnpo", **{**common, "old_logps": old[rows], "ref_logps": ref[rows]})
        means.append(policy_objective(logps[rows], advantages[rows], mask[rows], **part)[0])
        shares.append(policy_objective(logps[rows], advantages[rows], mask[rows], num_batches_global=2, **part)[0])
    assert torch.allclose(sum(shares), (means[0] + means[1]) / 2)


def test_statistics_of_an_empty_batch():
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, terms = policy_objective(logps, torch.tensor([1.0, -1.0]), mask, loss_type="dapo", num_tokens_global=0,
                                   entropies=torch.ones(2, 3))
    assert loss.item() == 0.0
    stats = policy_stats(terms.names, terms.sums, terms.counts, terms.extremes)
    assert stats["entropy"] == 0.0 and stats["clip_ratio/low_mean"] == 0.0
    assert math.isnan(stats["clip_ratio/low_min"]) and math.isnan(stats["clip_ratio/high_max"])


def test_statistics_sum_over_micro_batches():
    """Sums and counts of two micro-batches give the statistics of the whole batch."""
    logps, old, ref, advantages, mask = batch(lengths=(4, 2, 0, 3, 1, 4))
    entropies = torch.rand(mask.shape)
    common = dict(ref_logps=ref, beta=0.04, entropies=entropies, old_logps=old)
    whole = policy_terms(logps, advantages, mask, **common)
    parts = [policy_terms(logps[rows], advantages[rows], mask[rows],
                          **{key: value[rows] if torch.is_tensor(value) else value for key, value in common.items()})
             for rows in (slice(0, 2), slice(2, 6))]
    extremes = torch.stack([torch.stack([part.extremes[0] for part in parts]).min(),
                            torch.stack([part.extremes[1] for part in parts]).max()])
    summed = policy_stats(whole.names, sum(part.sums for part in parts), sum(part.counts for part in parts), extremes)
    expected = policy_stats(whole.names, whole.sums, whole.counts, whole.extremes)
    assert summed.keys() == expected.keys() == {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"}
    for name, value in expected.items():
        assert math.isclose(summed[name], value, rel_tol=1e-6, abs_tol=1e-7), name


def test_fp64_stays_fp64():
    logps, old, ref, advantages, mask = batch()
    loss, terms = policy_objective(logps.detach().double(), advantages, mask, old_logps=old, ref_logps=ref, beta=0.1,
                                   loss_type="grpo", num_sequences_global=4)
    assert loss.dtype == torch.float64 and terms.sums.dtype == torch.float64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "grpo"}, "needs num_sequences_global"),
        ({"loss_type": "dr_grpo", "num_sequences_global": 4}, "needs max_completion_length"),
        ({"loss_type": "dapo"}, "needs num_tokens_global"),
        ({"loss_type": "bnpo", "num_batches_global": 0}, "at least 1"),
        ({"loss_type": "cispo"}, "unknown RL loss_type"),
        ({"loss_type": "bnpo", "beta": 0.1}, "needs the reference"),
        ({"loss_type": "bnpo", "importance_sampling_level": "batch"}, "unknown importance_sampling_level"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    logps, _, _, advantages, mask = batch()
    with pytest.raises(ValueError, match=message):
        policy_objective(logps, advantages, mask, **kwargs)
