"""One optimizer step's numbers (`StepResult`), kept on the device until a logging step reads them.

A step's loss, gradient norm, token and FLOP counts and its family statistics (`mmfsdp.model.StepTerms`)
are device tensors when the step ends; reading one would make the host wait for the device every step.
The loss and the counts are summed over the ranks by collectives started without waiting (`reductions`,
the handles of `all_reduce(..., async_op=True)`): they run while the optimizer steps and the next step
begins, and nothing waits for them until the numbers are read. `settle` waits for those reductions and turns
every pending result into Python numbers with one transfer per kind (floats, integer
counts), which the metrics component does on logging steps and before every checkpoint
(`mmfsdp.train.metrics.Metrics`); `first_non_finite` then finds the first step whose loss or gradient
norm is NaN/inf, so a non-finite step is still caught, at most `log_interval` steps late and never after
a save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mmfsdp.model.flops import ForwardFlops

__all__ = ["StepResult", "TrainingError", "NonFiniteLoss", "settle", "first_non_finite"]


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, unusable checkpoint); the message says why and what to do."""


class NonFiniteLoss(TrainingError):
    """A step's loss or gradient norm is NaN/inf; `last_finite_step` is the step before it."""

    def __init__(self, message: str, *, last_finite_step: int):
        super().__init__(message)
        self.last_finite_step = last_finite_step


@dataclass(slots=True)
class StepResult:
    """One optimizer step: Python numbers once `settled`, device tensors (`pending`) until then."""

    step: int
    lr: float
    """The learning rate the step used."""
    loss: float = math.nan
    """The LM loss of the global batch (a family's extra loss terms are not in it)."""
    grad_norm: float = math.nan
    num_tokens: int = 0
    flops: ForwardFlops = ForwardFlops()
    """Forward FLOPs of the step's global batch (`mmfsdp.model.flops`; MFU from it)."""
    stats: dict[str, float] = field(default_factory=dict)
    """The family's statistics of the step (`StepTerms.stats`, e.g. a MoE's `aux_loss`, `expert_load_max`)."""
    pending: dict[str, Any] | None = None
    """Until settled: `loss`, `grad_norm` (0-d), `counts` (int64 `[tokens, FLOPs in layers, other FLOPs]`) and
    `stats` (name -> 0-d) as device tensors, and `reductions`: the handles of the collectives still writing into
    them (waited for before they are read)."""

    @property
    def settled(self) -> bool:
        return self.pending is None

    @classmethod
    def on_device(cls, step: int, lr: float, *, loss: torch.Tensor, grad_norm: torch.Tensor, counts: torch.Tensor,
                  stats: dict[str, torch.Tensor], reductions: Sequence[Any] = ()) -> StepResult:
        """`reductions`: the work handles of asynchronous collectives that write into `loss` or `counts`."""
        return cls(step, lr, pending={"loss": loss, "grad_norm": grad_norm, "counts": counts, "stats": stats,
                                      "reductions": list(reductions)})


def settle(results: Sequence[StepResult]) -> None:
    """Read the device values of every unsettled result (after its reductions): one host transfer for the floats,
    one for the counts."""
    todo = [r for r in results if not r.settled]
    if not todo:
        return
    for result in todo:
        for work in result.pending["reductions"]:
            work.wait()
    device = todo[0].pending["loss"].device
    floats = [
        value.detach().reshape(()).to(device, torch.float64)
        for r in todo
        for value in (r.pending["loss"], r.pending["grad_norm"], *r.pending["stats"].values())
    ]
    values = iter(torch.stack(floats).tolist())
    counts = torch.stack([r.pending["counts"].to(device) for r in todo]).tolist()
    for result, (num_tokens, layers, other) in zip(todo, counts):
        result.loss, result.grad_norm = next(values), next(values)
        result.stats = {name: next(values) for name in result.pending["stats"]}
        result.num_tokens, result.flops = num_tokens, ForwardFlops(layers, other)
        result.pending = None


def first_non_finite(results: Sequence[StepResult]) -> int | None:
    """The index of the first settled result whose loss or gradient norm is NaN/inf; None when all are finite."""
    for index, result in enumerate(results):
        if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
            return index
    return None
