"""Targets and loss weights: shift_labels, the three normalisations (single process), the weighted CE."""

import pytest
import torch
import torch.nn.functional as F

from mmfsdp.model import compute_loss_weights, sample_starts, shift_labels, weighted_cross_entropy
from mmfsdp.parallel.testing import assert_within

IGNORE = -100


def test_shift_labels_moves_targets_left_and_masks_the_last_position():
    labels = torch.tensor([[IGNORE, 5, 6, 7], [1, 2, IGNORE, 4]])
    assert shift_labels(labels).tolist() == [[5, 6, 7, IGNORE], [2, IGNORE, 4, IGNORE]]


def test_shift_labels_masks_the_last_token_of_every_packed_sample():
    labels = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    cu_seq_lens = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    assert shift_labels(labels, cu_seq_lens).tolist() == [[2, 3, IGNORE, 5, IGNORE, 7, IGNORE]]


def test_packed_sample_boundaries_come_from_cu_seq_lens_over_all_rows():
    labels = torch.arange(1, 9).reshape(2, 4)
    cu_seq_lens = torch.tensor([0, 2, 4, 5, 8], dtype=torch.int32)  # row 0: [2 | 2], row 1: [1 | 3]
    assert sample_starts(labels.shape, cu_seq_lens).tolist() == [[True, False, True, False], [True, True, False, False]]
    assert shift_labels(labels, cu_seq_lens).tolist() == [[2, IGNORE, 4, IGNORE], [IGNORE, 7, 8, IGNORE]]


def test_boundaries_do_not_read_position_values():
    """M-RoPE positions are [3, B, S] and need not restart at 0: without cu_seq_lens a row is one sample."""
    labels = torch.tensor([[1, 2, 3, 4]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, IGNORE]]
    (weights,) = compute_loss_weights([shift_labels(labels)], loss_type="per_sample")
    assert torch.allclose(weights, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


def _micro_batches():
    """Three micro-batches: uneven trained-token counts, one with none, one packed."""
    a = torch.tensor([[IGNORE, 3, 4, 5, IGNORE], [IGNORE, IGNORE, 9, IGNORE, IGNORE]])
    b = torch.full((2, 5), IGNORE)
    c = torch.tensor([[1, 2, IGNORE, 3, 4, 5, IGNORE, 6]])
    c_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])  # samples: tokens 0-2, 3-6, 7
    c_cu_seq_lens = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    return [a, b, c], [None, None, c_positions], [None, None, c_cu_seq_lens]


def _expected_per_sample(targets, positions):
    """Per-sample weights by explicit loops (samples where positions restart, an independent spelling of
    the same boundaries): 1 / (number of samples with trained tokens × sample's trained tokens)."""
    samples = []  # (micro-batch, row, columns) of every sample
    for m, (t, pos) in enumerate(zip(targets, positions)):
        for row in range(t.shape[0]):
            columns = []
            for col in range(t.shape[1]):
                if col > 0 and pos is not None and pos[row, col] == 0:
                    samples.append((m, row, columns))
                    columns = []
                columns.append(col)
            samples.append((m, row, columns))
    counted = [(m, row, cols, sum(int(targets[m][row, c] != IGNORE) for c in cols)) for m, row, cols in samples]
    num_samples = sum(1 for *_, n in counted if n > 0)
    expected = [torch.zeros(t.shape) for t in targets]
    for m, row, cols, n in counted:
        for c in cols:
            if targets[m][row, c] != IGNORE:
                expected[m][row, c] = 1.0 / (num_samples * n)
    return expected


def test_default_weights_are_one_over_all_trained_tokens_of_the_step():
    targets, *_ = _micro_batches()
    weights = compute_loss_weights(targets, loss_type="default")
    num_trained = sum(int((t != IGNORE).sum()) for t in targets)
    for t, w in zip(targets, weights):
        assert w.dtype == torch.float32
        assert torch.equal(w, torch.where(t != IGNORE, 1.0 / num_trained, 0.0).float())
    assert abs(sum(w.sum().item() for w in weights) - 1.0) < 1e-6


def test_per_token_weights_are_mindspeed_per_micro_batch_weights_over_m_times_d():
    """MindSpeed-MM divides each micro-batch's sum by N̄ = N / M and its trainer by M: here one weight 1 / (M · N̄)."""
    targets, *_ = _micro_batches()
    weights = compute_loss_weights(targets, loss_type="per_token", num_micro_batches=3)
    average = sum(int((t != IGNORE).sum()) for t in targets) / 3  # N̄ on one rank (D = 1)
    for t, w in zip(targets, weights):
        assert torch.allclose(w, torch.where(t != IGNORE, 1.0 / (3 * average), 0.0).float(), rtol=1e-7, atol=0)
    # the step objective does not grow with the number of micro-batches: it is the global token mean
    assert abs(sum(w.sum().item() for w in weights) - 1.0) < 1e-6
    assert all(torch.equal(w, d) for w, d in zip(weights, compute_loss_weights(targets, loss_type="default")))


def test_per_sample_weights_average_the_sample_means():
    targets, positions, cu_seq_lens = _micro_batches()
    weights = compute_loss_weights(targets, loss_type="per_sample", cu_seq_lens=cu_seq_lens)
    for w, e in zip(weights, _expected_per_sample(targets, positions)):
        assert torch.allclose(w, e, rtol=1e-7, atol=0)


@pytest.mark.parametrize("loss_type", ["default", "per_sample", "per_token"])
def test_no_trained_token_anywhere_gives_zero_weights(loss_type):
    targets = [torch.full((2, 4), IGNORE), torch.full((1, 3), IGNORE)]
    weights = compute_loss_weights(targets, loss_type=loss_type)
    assert all(torch.isfinite(w).all() and not w.any() for w in weights)


def test_mismatched_micro_batch_count_is_an_error():
    targets, *_ = _micro_batches()
    with pytest.raises(ValueError, match="num_micro_batches"):
        compute_loss_weights(targets, num_micro_batches=2)


def test_weighted_cross_entropy_is_the_weighted_sum_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    targets = torch.tensor([[1, IGNORE, 3, 4, 10], [IGNORE, IGNORE, 0, 2, 7]])
    weights = torch.rand(2, 5)
    expected = sum(
        weights[b, t].item() * F.cross_entropy(logits[b, t].float()[None], targets[b, t][None]).item()
        for b in range(2) for t in range(5) if targets[b, t] != IGNORE
    )
    loss = weighted_cross_entropy(logits, targets, weights)
    assert loss.dtype == torch.float32
    assert_within(abs(loss.item() - expected) / abs(expected), 1e-5, "loss")
