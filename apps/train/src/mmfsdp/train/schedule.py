"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to `lr_min`.

`lr_at(step)` is a pure function of the optimizer step (0-based: the LR used by
the step that is about to run), so a resumed run recomputes exactly the LR the
uninterrupted run would have used; the scheduler wrapper only stores the step.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, lr_min: float, total_steps: int, warmup_ratio: float, style: str) -> float:
    warmup_steps = int(round(warmup_ratio * total_steps))
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if style == "constant":
        return lr
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if style == "linear":
        return lr_min + (lr - lr_min) * (1.0 - progress)
    if style == "cosine":
        return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_decay_style {style!r}")


class Scheduler:
    """Sets each param group's LR from `lr_at`; `state_dict` is the step count only."""

    def __init__(self, optimizer: torch.optim.Optimizer, **schedule: float | int | str):
        self.optimizer = optimizer
        self.schedule = schedule
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        value = lr_at(self.step_count, **self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = value

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
