"""A `stage: grpo` step's training micro-batches (`mmfsdp.train.grpo`, step 4 of its docstring): each sequence is
prompt + completion with labels on the completion (`training_sequence`), collated by the family collator as the
run's layout says (padded or padding-free), and the host works out once where each completion's trained tokens lie
in the flattened batch (`training_plan`), so the per-token log-probs of the forward are picked with one gather."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmfsdp.model.loss import IGNORE_INDEX, sample_ids, shift_labels

__all__ = ["TrainingPlan", "training_plan", "training_sequence"]


@dataclass(slots=True)
class TrainingPlan:
    """One training micro-batch: its batch, targets, unit weights on the trained tokens, and per completion
    (in the order of the sequences) where its tokens lie in the flattened batch and the engine's log-probs."""

    batch: dict[str, Any]
    targets: torch.Tensor
    weights: torch.Tensor
    index: torch.Tensor
    """int64 `[n, T]`: the flattened positions of completion k's trained tokens, 0-padded (see `mask`)."""
    mask: torch.Tensor
    """fp32 `[n, T]`: 1 on completion tokens that train."""
    engine_logps: torch.Tensor
    """fp32 `[n, T]`: the engine's sampling log-probs of the same tokens."""
    advantages: torch.Tensor
    """fp32 `[n]`."""


def training_sequence(sample: dict[str, Any], completion: list[int], trains: bool, plugin: Any) -> dict[str, Any]:
    """Prompt + completion as a sample of the family collator: labels on the completion (none when it does not
    train), the plugin's per-token inputs 0 on it (completion tokens are text), the prompt's media."""
    prompt_ids = sample["input_ids"]
    ids = torch.cat([prompt_ids, torch.tensor(completion, dtype=prompt_ids.dtype)])
    labels = torch.full_like(ids, IGNORE_INDEX)
    if trains:
        labels[len(prompt_ids) :] = ids[len(prompt_ids) :]
    out = {**sample, "input_ids": ids, "labels": labels}
    for key in plugin.token_inputs(prompt_ids[:1]):
        values = torch.as_tensor(sample[key])
        out[key] = torch.cat([values, values.new_zeros(len(completion))])
    return out


def training_plan(sequences: list[dict[str, Any]], engine: list[torch.Tensor], advantages: torch.Tensor, *,
                  collator: Any, device: torch.device) -> TrainingPlan:
    """The micro-batch of `sequences` (`training_sequence`'s; one packed row or a row each, as `collator` packs),
    with the engine's sampling log-probs and the advantages of their completions, on `device`."""
    rows = [sequences] if collator.packing else [[s] for s in sequences]
    batch = collator(rows)
    cu = batch.get("cu_seq_lens")
    targets = shift_labels(batch["labels"], cu)
    ids = sample_ids(targets.shape, cu).reshape(-1)
    trained = (targets.reshape(-1) != IGNORE_INDEX)
    width = max([len(e) for e in engine] + [1])
    index = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width)
    engine_logps = torch.zeros(len(sequences), width)
    for k, logps in enumerate(engine):
        positions = torch.nonzero((ids == k) & trained).reshape(-1)
        index[k, : len(positions)] = positions
        mask[k, : len(positions)] = 1.0
        engine_logps[k, : len(logps)] = logps
    return TrainingPlan(batch=batch, targets=targets.to(device),
                        weights=trained.reshape(targets.shape).float().to(device), index=index.to(device),
                        mask=mask.to(device), engine_logps=engine_logps.to(device),
                        advantages=advantages.float().to(device))
