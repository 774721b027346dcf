"""Where a run starts: one resume rule, whatever the init path.

A run resumes whenever there is a training iteration to resume from, and uses
initial weights only when there is none:

1. `training.save` holds a checkpoint (its tracker's iteration, or the newest
   whole `iter_*` when the tracker is gone): resume from it.
2. Else `training.load` (DCP) is, or holds, a training iteration: resume from it.
3. Else initial weights: `training.load` as an HF directory (`load_format: hf`)
   or a DCP `release` (from `mm-convert`); else `model.model_name_or_path`'s
   safetensors; else random weights (`model.random_init`).

Resuming restores model, optimizer, scheduler, data position and RNG. Under
`init_model_with_meta_device` the sharded, materialised model is filled from
the resume checkpoint directly, never from the initial weights first. A damaged
checkpoint is an error naming the file, or with `training.resume_fallback` the
newest whole older one (`mmfsdp.ckpt.find_resume_point`). The table is in
docs/checkpoints.md ("Where a run starts").

`plan_start` is collective (checkpoint verification agrees across ranks) and
runs before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mmfsdp.ckpt import RELEASE, CheckpointError, ResumePoint, find_resume_point, resolve_checkpoint, verify_checkpoint
from mmfsdp.config import ConfigError

__all__ = ["StartPlan", "plan_start"]

WeightsSource = Literal["checkpoint", "hf", "release", "pretrained", "random"]


@dataclass(frozen=True, slots=True)
class StartPlan:
    """How this run starts: resumed from `resume`, or from the initial weights `weights` at `source`."""

    weights: WeightsSource
    """Where the model's weights come from."""
    source: str | None
    """The directory they are read from (None for random weights)."""
    resume: ResumePoint | None = None
    """The checkpoint resumed from (weights == "checkpoint")."""

    def describe(self) -> str:
        """The one log line saying which case applied."""
        if self.resume is not None:
            line = f"start: resuming from {self.resume.path} (step {self.resume.iteration}: model, optimizer, scheduler, data position, RNG)"
            return line + (f" — {self.resume.note}" if self.resume.note else "")
        what = {
            "hf": "HF weights from training.load",
            "release": "released DCP weights from training.load",
            "pretrained": "HF weights from model.model_name_or_path",
            "random": "random weights (model.random_init)",
        }[self.weights]
        return f"start: no checkpoint to resume; training starts at step 1 from {what}" + (f" {self.source}" if self.source else "")


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _direct_iteration(load: str) -> ResumePoint | None:
    """`training.load` naming an `iter_*` directory itself."""
    path, iteration = resolve_checkpoint(load)
    if iteration == RELEASE:
        return None
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"cannot resume from training.load {load}: {problem}; restore it or point at another checkpoint")
    return ResumePoint(path, int(iteration), None)


def plan_start(training, model) -> StartPlan:
    """Apply the rule above to the `training` and `model` config sections (collective)."""
    t = training
    point = find_resume_point(t.save, fallback=t.resume_fallback)
    load_is_dcp = t.load is not None and t.load_format == "dcp"
    if point is None and load_is_dcp and not _same_dir(t.load, t.save) and Path(t.load).is_dir():
        if (Path(t.load) / ".metadata").is_file():
            point = _direct_iteration(t.load)
        else:
            point = find_resume_point(t.load, fallback=t.resume_fallback)
    if point is not None:
        return StartPlan("checkpoint", str(point.path), point)
    if t.load is not None and t.load_format == "hf":
        return StartPlan("hf", t.load)
    if load_is_dcp and not _same_dir(t.load, t.save):
        if not Path(t.load).is_dir():
            raise ConfigError("training.load", f"{t.load} does not exist; give a DCP checkpoint directory, or load_format: hf")
        path, iteration = resolve_checkpoint(t.load)  # raises a clear error for a directory without a checkpoint
        if iteration == RELEASE:
            return StartPlan("release", str(path))
    if model.random_init:
        return StartPlan("random", None)
    if model.model_name_or_path:
        return StartPlan("pretrained", model.model_name_or_path)
    raise ConfigError(
        "training.load",
        "nothing to start from: no checkpoint to resume, no initial weights (training.load or "
        "model.model_name_or_path) and model.random_init is false",
    )
