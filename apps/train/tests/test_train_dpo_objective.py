"""`PreferenceObjective` on hand-made micro-batches: a token-budget step's filler pair (all labels -100) counts in
neither the pair count nor the loss nor the statistics; the global pair count spans the step's micro-batches."""

from types import SimpleNamespace

import torch

from mmfsdp.model.preference import pair_losses
from mmfsdp.train.dpo import PreferenceObjective


class _Model:
    """Returns fixed per-sequence cross-entropies (the training forward's `.loss` with `sequence_ids`)."""

    def __init__(self, ce: list[float]):
        self.ce = torch.tensor(ce, requires_grad=True)

    def __call__(self, **kwargs):
        assert kwargs["num_sequences"] == self.ce.numel()
        return SimpleNamespace(loss=self.ce * 1.0)


class _Reference:
    def logps(self, inputs, seq, pair_index):
        return -torch.full((seq["num_sequences"],), 2.0)


def _cfg():
    dpo = SimpleNamespace(loss_type="sigmoid", beta=0.5, label_smoothing=0.0, rpo_alpha=0.25)
    return SimpleNamespace(training=SimpleNamespace(dpo=dpo))


def _mb(trained: list[int], pair_index: list[int]) -> dict:
    """Padded rows, one per sequence: row k has `trained[k]` labelled tokens."""
    labels = torch.full((len(trained), 6), -100)
    for row, n in enumerate(trained):
        labels[row, 1 : 1 + n] = 7
    return {"labels": labels, "pair_index": torch.tensor(pair_index)}


def test_filler_pairs_count_nowhere():
    dims = SimpleNamespace(cp_size=1, dp_size=1, dp_group=None)
    objective = PreferenceObjective(_cfg(), dims, torch.device("cpu"), _Reference())
    first, second = _mb([3, 2, 0, 0], [4, 4]), _mb([2, 4], [9])  # pair 1 of the first micro-batch is a filler
    objective.start_step([first, second])
    _, loss_a = objective.micro_batch(_Model([1.0, 3.0, 0.0, 0.0]), 0, {})
    _, loss_b = objective.micro_batch(_Model([2.5, 1.5]), 1, {})
    stats, reductions = objective.stats()
    assert reductions == []
    # the two real pairs alone: the mean of their losses + rpo_alpha x the chosen CE per chosen target
    terms = pair_losses(torch.tensor([-1.0, -3.0, -2.5, -1.5]), -torch.full((4,), 2.0), torch.ones(4),
                        loss_type="sigmoid", beta=0.5)
    assert float(objective._pairs_global) == 2.0
    chosen_targets = float(objective._chosen_tokens_global)
    assert chosen_targets == 3 + 2  # the chosen rows of the two real pairs
    manual = terms.losses.mean() + 0.25 * (1.0 + 2.5) / chosen_targets
    assert torch.allclose(loss_a + loss_b, manual, rtol=1e-6)
    for index, name in enumerate(("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")):
        assert torch.allclose(stats[name], terms.stats[index].mean(), rtol=1e-6), name
