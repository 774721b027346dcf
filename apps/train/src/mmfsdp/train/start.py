"""Where a run starts: one resume rule, whatever the init path.

A run resumes whenever there is a training iteration to resume from, and uses
initial weights only when there is none:

1. `training.save` holds a checkpoint (its tracker's iteration, or the newest
   whole `iter_*` when the tracker is gone): resume from it.
2. Else `training.load` (DCP) is, or holds, a training iteration: resume from it — unless another stage trained it
   (`checkpoint.json`'s `metadata.stage`, none: `sft`; the stage's objective decides, `Objective.resumes`), e.g.
   a DPO run whose `training.load` is its SFT run's checkpoint: its model weights are then this run's initial
   weights (as a `release`), and the run starts at step 1.
3. Else initial weights: `training.load` as an HF directory (`load_format: hf`)
   or a DCP `release` (from `mm-convert`); else `model.model_name_or_path`'s
   safetensors; else random weights (`model.random_init`).

Resuming restores model, optimizer, scheduler, data position and RNG. Under
`init_model_with_meta_device` the sharded, materialised model is filled from
the resume checkpoint directly, never from the initial weights first — except
from an adapter-only checkpoint (`training.lora`; `checkpoint.json` says
`"trainable_only": true`), which holds no base: the frozen base then comes from
the initial weights of rule 3, the adapters and the rest from the checkpoint. A damaged
checkpoint is an error naming the file, or with `training.resume_fallback` the
newest whole older one (`mmfsdp.ckpt.find_resume_point`). The table is in
docs/checkpoints.md ("Where a run starts").

A run whose own `training.save` holds the checkpoint it would resume, at or past
`training.train_iters`, is finished: `finished_run` says so in one line and the app
exits 0 before it starts any rank (its checkpoint, HF export and eval.json are
those of the run that finished). Raising `training.train_iters` trains on from that
checkpoint; another `training.save` (or moving this one away) trains again from the
start. So every command runs twice in a row: the second run resumes a half-finished
run and says "finished" of a finished one, whatever it saved (`no_save_optim`
included: a finished run is never loaded).

`plan_start` is collective (checkpoint verification agrees across ranks) and
runs before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mmfsdp.ckpt import (
    RELEASE,
    CheckpointError,
    ResumePoint,
    find_resume_point,
    read_checkpoint_info,
    resolve_checkpoint,
    verify_checkpoint,
)
from mmfsdp.config import ConfigError
from mmfsdp.train.stages import objective_class

__all__ = ["StartPlan", "finished_run", "plan_start"]

WeightsSource = Literal["checkpoint", "hf", "release", "pretrained", "random"]


@dataclass(frozen=True, slots=True)
class StartPlan:
    """How this run starts: from the weights `weights` at `source`, then resumed from `resume` if set."""

    weights: WeightsSource
    """Where the model's weights come from: "checkpoint" (the resume checkpoint holds them all), or the initial
    weights — for a fresh start, or under an adapter-only resume for the frozen base."""
    source: str | None
    """The directory they are read from (None for random weights)."""
    resume: ResumePoint | None = None
    """The checkpoint resumed from (weights == "checkpoint", or an adapter-only one on the initial weights)."""
    note: str | None = None
    """What the initial weights are when the log line should say more (another stage's checkpoint)."""

    def describe(self) -> str:
        """The one log line saying which case applied."""
        source = f" {self.source}" if self.source else ""
        if self.resume is not None:
            if self.weights == "checkpoint":
                line = f"start: resuming from {self.resume.path} (step {self.resume.iteration}: model, optimizer, scheduler, data position, RNG)"
            else:
                line = (f"start: resuming from {self.resume.path} (step {self.resume.iteration}: LoRA adapters, optimizer, "
                        f"scheduler, data position, RNG) on the frozen base from {_WHAT[self.weights]}{source}")
            return line + (f" — {self.resume.note}" if self.resume.note else "")
        what = f"the model weights of {self.note} in training.load" if self.note else _WHAT[self.weights]
        return f"start: no checkpoint to resume; training starts at step 1 from {what}{source}"


_WHAT = {
    "hf": "HF weights from training.load",
    "release": "released DCP weights from training.load",
    "pretrained": "HF weights from model.model_name_or_path",
    "random": "random weights (model.random_init)",
}


def _from_save(point: ResumePoint, save: str | None) -> bool:
    """Whether the resume point lies in `training.save` (this run's own checkpoints: always resumed)."""
    return save is not None and Path(save).resolve() in Path(point.path).resolve().parents


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
    if point is None:
        return _initial_weights(t, model)
    info = read_checkpoint_info(point.path)
    adapter_only = bool(info.get("trainable_only"))
    objective = objective_class(t.stage)
    stage = objective.recorded_stage(info.get("metadata"))
    own_stage = objective.resumes(info.get("metadata"))
    if not own_stage and _from_save(point, t.save):
        raise ConfigError("training.save", (
            f"{point.path} is a checkpoint of a {stage} run, this run's training.stage is {t.stage}: give this run its "
            f"own training.save, and the {stage} checkpoint as training.load to start from its weights"
        ))
    if not own_stage:
        if adapter_only:
            raise ConfigError("training.load", (
                f"{point.path} holds the LoRA adapters of a {stage} run, no model to start this {t.stage} run from: "
                "export them (mm-convert LoraConverter dcp_to_peft) and give that directory as "
                "training.lora.pretrained_lora_path, with the base model as training.load or model.model_name_or_path"
            ))
        return StartPlan("release", str(point.path), note=f"the {stage} checkpoint of step {point.iteration}")
    if adapter_only != t.lora.enable:
        raise ConfigError("training.lora.enable", (
            f"{point.path} holds only LoRA adapters (its run had training.lora.enable: true); resume it with the same "
            "training.lora, or start a new training.save" if adapter_only else
            f"{point.path} holds a whole model (its run trained without LoRA); LoRA resumes only from its own adapter "
            "checkpoints: export it (mm-convert GenericDCPConverter dcp_to_hf), start from that as training.load "
            "(load_format: hf) and give a new training.save"
        ))
    if not adapter_only:
        return StartPlan("checkpoint", str(point.path), point)
    base = _initial_weights(t, model)
    return StartPlan(base.weights, base.source, point)


def finished_run(training, model) -> str | None:
    """The `start:` line of a finished run — `plan_start` resumes a checkpoint of `training.save` (this run's own)
    at or past `training.train_iters` — or None when there is training left. None too when `plan_start` raises:
    the run's ranks report that error as they start."""
    try:
        point = plan_start(training, model).resume
    except (ConfigError, CheckpointError):
        return None
    if point is None or not _from_save(point, training.save) or point.iteration < training.train_iters:
        return None
    return (
        f"start: the run is finished: {point.path} is step {point.iteration} of training.train_iters "
        f"{training.train_iters}; nothing to train. Raise training.train_iters to train on from it; give another "
        f"training.save (or move {training.save} away) to train again from the start"
    )


def _initial_weights(t, model) -> StartPlan:
    """Rule 3: the initial weights (a fresh start, or the frozen base under an adapter-only resume)."""
    load_is_dcp = t.load is not None and t.load_format == "dcp"
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
