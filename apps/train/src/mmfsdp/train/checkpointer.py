"""Checkpointing, a component of the training loop (`Checkpointer`): resume, the interval and final saves,
and the HF export of each save (`training.save_format: hf`). File formats are `mmfsdp.ckpt`'s.

- `resume(point)` loads model, optimizer (unless `no_load_optim`), RNG (unless `no_load_rng`) and the run's
  own state (step, scheduler, data position: the trainer's `load_state_dict`) from a checkpoint.
- `save(step)` after each step saves when `step` is a multiple of `save_interval`; `save(step, last=True)`
  after the loop saves the final state unless that step was just saved. Nothing is saved without
  `training.save`.
- Before each save it calls `before_save` (the metrics component's `check`): a step whose loss or
  gradient norm is not finite raises there, so it is never saved.
- What is saved comes from the `Trainable` (adapter-only under LoRA, with the adapter settings); the trainer's
  `state_dict()` (the same on every rank) and `rank_state_dict()` (this rank's data position) go with it, and the
  stage's `checkpoint_metadata()` (the stage that trained it: a run of another stage starts from its weights
  instead of resuming it, `mmfsdp.train.start`), and the stop tokens of the run's chat template (`export_metadata`:
  what every HF export of the checkpoint writes in `generation_config.json`, `mmfsdp.ckpt.export_config`).
- With `save_format: hf`, rank 0 converts the checkpoint just published to an HF directory (an async save is
  waited for first).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from mmfsdp.ckpt import export_checkpoint_hf, finalize_pending, load_checkpoint, save_checkpoint
from mmfsdp.config import get_logger
from mmfsdp.train.stages import objective_class
from mmfsdp.train.supervise import LoopHeartbeat
from mmfsdp.train.trainable import Trainable

__all__ = ["Checkpointer", "TrainState"]

log = get_logger("mmfsdp.train")


class TrainState(Protocol):
    """The run's own state beside model and optimizer (the trainer: step, scheduler, data position)."""

    def state_dict(self) -> dict[str, Any]: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any] | None) -> None: ...


class Checkpointer:
    """Resume and saves of one run (module docstring)."""

    def __init__(
        self, training_cfg: Any, *, hf_source: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        state: TrainState, trainable: Trainable, heartbeat: LoopHeartbeat, rank: int,
        before_save: Callable[[], None] = lambda: None, export_metadata: dict[str, Any] | None = None,
    ):
        """`hf_source`: the HF directory whose config and tokenizer files go with an HF export; `export_metadata`:
        what the checkpoints record for their HF exports (`mmfsdp.ckpt.generation_metadata`)."""
        self.cfg = training_cfg
        self.hf_source = hf_source
        self.export_metadata = export_metadata or {}
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.stage = objective_class(training_cfg.stage)
        """The stage's objective class: what its checkpoints record (`checkpoint_metadata`)."""
        self.trainable = trainable
        self.heartbeat = heartbeat
        self.rank = rank
        self.before_save = before_save

    def resume(self, point: Any) -> int:
        """Load the checkpoint at `point` (a `mmfsdp.ckpt.ResumePoint`); returns its step."""
        t = self.cfg
        loaded = load_checkpoint(
            point.path, model=self.model, optimizer=None if t.no_load_optim else self.optimizer,
            load_optim=not t.no_load_optim, load_rng=not t.no_load_rng,
        )
        self.state.load_state_dict(loaded.app_state, loaded.rank_state)
        step = int(loaded.app_state["step"])
        log.info(f"resumed from {loaded.path} at step {step}")
        return step

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether `save(step, last=last)` saves."""
        t = self.cfg
        on_interval = bool(t.save_interval) and step % t.save_interval == 0
        return bool(t.save) and (not on_interval if last else on_interval)

    def save(self, step: int, *, last: bool = False) -> None:
        """Save the state after `step` if it is due (every `save_interval` steps; `last`: the end of the run)."""
        if not self.due(step, last=last):
            return
        t = self.cfg
        self.before_save()
        options = self.trainable.save_options()
        options["metadata"] = {
            **(options["metadata"] or {}), **self.stage.checkpoint_metadata(), **self.export_metadata,
        }
        with self.heartbeat.paused(f"saving the checkpoint of step {step}", step):
            save_checkpoint(
                t.save, step, model=self.model, optimizer=None if t.no_save_optim else self.optimizer,
                app_state=self.state.state_dict(), rank_state=self.state.rank_state_dict(),
                async_save=t.save_async, keep_last=t.save_total_limit, **options,
            )
            log.info(f"saved checkpoint at step {step} under {t.save}")
            if t.save_format == "hf":
                self._export_hf(step)

    def _export_hf(self, step: int) -> None:
        """The checkpoint just saved, as an HF directory (rank 0 converts the published DCP files)."""
        finalize_pending()
        if self.rank == 0:
            out = export_checkpoint_hf(self.cfg.save, step, self.hf_source)
            log.info(f"exported step {step} as HF safetensors to {out}")
        dist.barrier()

    def close(self) -> None:
        """Wait for an async save to be published."""
        finalize_pending()
