"""Resume policy: which training checkpoint a run continues from (`find_resume_point`), and whether one is
whole on every rank (`verify_checkpoint`).

The tracker's iteration once it is verified; without a tracker the newest whole `iter_*`; a damaged one is an
error naming the file, or (`fallback=True`, `training.resume_fallback`) the newest whole older one — never a
silent fresh start. docs/checkpoints.md, "Where a run starts", has the rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mmfsdp.ckpt.dcp_io import SafeFileSystemReader
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.layout import (
    RELEASE,
    TRACKER_FILENAME,
    check_complete,
    iteration_dirname,
    list_iterations,
    read_tracker,
)
from mmfsdp.ckpt.state_files import APP_STATE_FILENAME, dist_on, load_tensor_file, rank_filename, rank_world, read_info

__all__ = ["ResumePoint", "find_resume_point", "verify_checkpoint"]


def _agree(problem: str | None) -> str | None:
    """The first problem any rank found (rank order), the same on every rank."""
    if not dist_on():
        return problem
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p is not None), None)


def verify_checkpoint(path: Path) -> str | None:
    """Collective: None when iteration checkpoint `path` is whole for every rank, else the first problem found.

    Checks the files against `complete.json` (presence and size), that DCP's
    metadata reads, and that `app_state.pt` and this rank's `rank_<r>.pt` load
    (when the checkpoint was saved by this many processes). Reads no tensor data.
    """
    rank, world_size = rank_world()
    problem = check_complete(path)
    if problem is None:
        try:
            SafeFileSystemReader(os.fspath(path)).read_metadata()
            info = read_info(path)
            if (path / APP_STATE_FILENAME).is_file():
                load_tensor_file(path / APP_STATE_FILENAME, "global training state")
            if info.get("world_size") == world_size:
                load_tensor_file(path / rank_filename(rank), f"rank {rank} state")
        except CheckpointError as e:
            problem = str(e)
    return _agree(problem)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint a run continues from (see `find_resume_point`)."""

    path: Path
    """The `iter_NNNNNNN` directory."""
    iteration: int
    """Its iteration (the step the run continues after)."""
    note: str | None = None
    """Why this is not simply the tracker's checkpoint (missing tracker, fallback); None when it is."""


def find_resume_point(save_dir: str | os.PathLike | None, *, fallback: bool = False) -> ResumePoint | None:
    """Collective: the training checkpoint under `save_dir` to resume from, or None when there is none.

    - The tracker names iteration N and `iter_N` is whole: N.
    - The tracker names N but `iter_N` is damaged or gone: a `CheckpointError`
      naming the problem, or with `fallback` the newest whole older iteration
      (`note` says so); an error if there is none.
    - No tracker: the newest whole `iter_*` (`note` says so); an error if
      `iter_*` directories exist but none is whole, so a run never starts over
      silently next to its checkpoints. None when there are no `iter_*` at all.
    - The tracker names `release` (converted weights) or `save_dir` does not exist: None.
    """
    if save_dir is None:
        return None
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return None
    iterations = list_iterations(save_dir)
    tracker = save_dir / TRACKER_FILENAME
    if tracker.is_file():
        try:
            wanted: int | str | None = read_tracker(save_dir)
        except CheckpointError as e:
            if not fallback:
                raise CheckpointError(
                    f"{e}; or set training.resume_fallback: true to resume from the newest whole checkpoint"
                ) from None
            wanted, damaged = None, str(e)
        if wanted == RELEASE:
            return None
        if wanted is not None:
            path = save_dir / iteration_dirname(wanted)
            damaged = verify_checkpoint(path)
            if damaged is None:
                return ResumePoint(path, wanted, None)
        older = [i for i in reversed(iterations) if wanted is None or i < wanted]
        if not fallback:
            hint = f" to resume from iter {older[0]}, the newest older checkpoint" if older else ""
            raise CheckpointError(
                f"cannot resume from {save_dir}: {damaged}. Restore the file, "
                f"or set training.resume_fallback: true{hint}"
            )
        for iteration in older:
            path = save_dir / iteration_dirname(iteration)
            if verify_checkpoint(path) is None:
                note = f"{damaged}; falling back to {path.name} (training.resume_fallback)"
                return ResumePoint(path, iteration, note)
        raise CheckpointError(f"cannot resume from {save_dir}: {damaged}, and no older checkpoint is whole")
    if not iterations:
        return None
    problems = []
    for iteration in reversed(iterations):
        path = save_dir / iteration_dirname(iteration)
        problem = verify_checkpoint(path)
        if problem is None:
            note = f"{tracker} is missing; resuming from the newest whole checkpoint {path.name}"
            return ResumePoint(path, iteration, note)
        problems.append(problem)
    raise CheckpointError(
        f"{save_dir} holds iter_* checkpoints but none is whole ({problems[0]}); "
        "restore them, or move them away to start the run over"
    )
