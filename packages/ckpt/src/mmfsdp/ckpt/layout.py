"""The on-disk layout of a checkpoint directory and the atomic moves that keep it consistent.

```
<save>/latest_checkpointed_iteration.txt   "100" or "release"
<save>/iter_0000100/                       one complete DCP checkpoint (+ rank_*.pt, app_state.pt, complete.json)
<save>/release/                            converted weights (model only)
<save>/iter_0000200.tmp-<token>/           a save in progress (never read)
```

A checkpoint is written into a `.tmp-` directory, renamed to its final name once
every rank has finished, and only then does the tracker move, by writing a
temporary file, fsyncing it and `os.replace`-ing it over the old tracker. Just
before the rename rank 0 writes `complete.json`, the name and size of every file
of the checkpoint, so a later truncation or loss of a file is found before any
state is loaded. A crash
at any point therefore leaves the tracker pointing at a complete checkpoint (or
absent, before the first save). Everything here is plain file handling; callers
decide which rank runs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from mmfsdp.ckpt.errors import CheckpointError

__all__ = [
    "TRACKER_FILENAME",
    "RELEASE",
    "iteration_dirname",
    "read_tracker",
    "write_tracker",
    "resolve_checkpoint",
    "find_checkpoint",
    "checkpoint_near",
    "publish_dir",
    "list_iterations",
    "prune_checkpoints",
    "remove_stale_tmp_dirs",
    "COMPLETE_FILENAME",
    "write_complete_marker",
    "check_complete",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
DCP_METADATA_FILENAME = ".metadata"
COMPLETE_FILENAME = "complete.json"

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


def iteration_dirname(iteration: int | str) -> str:
    """`iter_0000100` for 100, `release` for "release"."""
    if iteration == RELEASE:
        return RELEASE
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old or the new content, never a mix."""
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_tracker(save_dir: str | os.PathLike, iteration: int | str) -> None:
    """Atomically point `save_dir`'s tracker at `iteration` (an int or "release")."""
    iteration_dirname(iteration)  # validates
    write_file_atomic(Path(save_dir) / TRACKER_FILENAME, f"{iteration}\n".encode())


def read_tracker(save_dir: str | os.PathLike) -> int | str:
    """The iteration (int) or "release" that `save_dir`'s tracker names."""
    save_dir = Path(save_dir)
    tracker = save_dir / TRACKER_FILENAME
    if not save_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {save_dir} does not exist; check training.load / --load_dir")
    if not tracker.is_file():
        near = checkpoint_near(save_dir)
        where = f"{_holdings(save_dir)}: point at {near}" if near is not None else (
            "point at a training.save directory or an `mm-convert ... hf_to_dcp --dcp_dir` output, or directly at an "
            "iter_*/release directory")
        raise CheckpointError(f"{save_dir} has no {TRACKER_FILENAME}; {where}")
    text = tracker.read_text().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(f"{tracker} contains {text!r}; expected an iteration number or 'release'")
    return int(text)


def _iteration_from_dirname(name: str) -> int | str | None:
    if name == RELEASE:
        return RELEASE
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def resolve_checkpoint(load_dir: str | os.PathLike) -> tuple[Path, int | str]:
    """(checkpoint directory, iteration) for a directory with a tracker, or an iter_*/release directory itself."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        near = checkpoint_near(load_dir)
        hint = f"; {_holdings(load_dir.parent)}: point at {near}" if near is not None else ""
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist; check training.load / --load_dir{hint}")
    if (load_dir / DCP_METADATA_FILENAME).is_file() and not (load_dir / TRACKER_FILENAME).exists():
        iteration = _iteration_from_dirname(load_dir.name)
        if iteration is None:
            raise CheckpointError(
                f"{load_dir} is a DCP checkpoint but its name is neither iter_NNNNNNN nor release, "
                "so its iteration is unknown; rename it or point at its parent directory with a tracker"
            )
        return load_dir, iteration
    iteration = read_tracker(load_dir)
    path = load_dir / iteration_dirname(iteration)
    if not (path / DCP_METADATA_FILENAME).is_file():
        state = "does not exist" if not path.exists() else f"has no {DCP_METADATA_FILENAME} (incomplete)"
        raise CheckpointError(
            f"{load_dir / TRACKER_FILENAME} points at {iteration!r} but {path} {state}; "
            "restore that directory or edit the tracker to name a complete checkpoint"
        )
    return path, iteration


def _loads(path: Path) -> bool:
    try:
        resolve_checkpoint(path)
    except CheckpointError:
        return False
    return True


def checkpoint_near(load_dir: str | os.PathLike) -> Path | None:
    """For a `load_dir` without a checkpoint, the directory next to it that has one (None when there is none).

    `load_dir` missing inside a save directory (e.g. `save/release` where training wrote only `iter_*`): the
    save directory when its tracker names a complete checkpoint, else its newest complete `iter_*`.
    `load_dir` itself a save directory without a tracker: its newest complete `iter_*`.
    """
    load_dir = Path(load_dir)
    save_dir = load_dir if load_dir.is_dir() else load_dir.parent
    if load_dir.is_dir() and (load_dir / TRACKER_FILENAME).exists():
        return None
    if save_dir != load_dir and (save_dir / TRACKER_FILENAME).is_file() and _loads(save_dir):
        return save_dir
    for iteration in reversed(list_iterations(save_dir)):
        path = save_dir / iteration_dirname(iteration)
        if (path / DCP_METADATA_FILENAME).is_file():
            return path
    return None


def _holdings(save_dir: Path) -> str:
    """`save holds iter_0000004, iter_0000008 (its tracker names 8), no release`, for messages."""
    names = [iteration_dirname(i) for i in list_iterations(save_dir)]
    if (save_dir / RELEASE).is_dir():
        names.append(RELEASE)
    tracker = save_dir / TRACKER_FILENAME
    named = tracker.read_text(errors="replace").strip()[:20] if tracker.is_file() else None
    tracked = f" (its tracker names {named})" if named else f" (no {TRACKER_FILENAME})"
    release = "" if RELEASE in names else f", no {RELEASE} (only `mm-convert ... hf_to_dcp` writes one)"
    return f"{save_dir} holds {', '.join(names) or 'no checkpoint'}{tracked}{release}"


def find_checkpoint(load_dir: str | os.PathLike | None) -> tuple[Path, int | str] | None:
    """Like `resolve_checkpoint`, but None when there is nothing to resume from yet.

    None when `load_dir` is None, does not exist, or has no tracker (a fresh
    `training.save` directory); a tracker that names a missing or incomplete
    checkpoint is still an error.
    """
    if load_dir is None:
        return None
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        return None
    if not (load_dir / TRACKER_FILENAME).exists() and not (load_dir / DCP_METADATA_FILENAME).is_file():
        return None
    return resolve_checkpoint(load_dir)


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished `tmp_dir` to `final_dir`, replacing an existing `final_dir`."""
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f"{final_dir.name}{_OLD_MARK}{uuid.uuid4().hex[:8]}")
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_complete_marker(ckpt_dir: Path) -> None:
    """Record the name and size of every file in `ckpt_dir` (call once all of them are written)."""
    files = {
        entry.name: entry.stat().st_size
        for entry in sorted(ckpt_dir.iterdir())
        if entry.is_file() and entry.name != COMPLETE_FILENAME and _TMP_MARK not in entry.name
    }
    write_file_atomic(ckpt_dir / COMPLETE_FILENAME, json.dumps({"files": files}, indent=1).encode())


def check_complete(ckpt_dir: Path) -> str | None:
    """None when `ckpt_dir` holds every file its `complete.json` lists, at the recorded size; else the problem.

    A directory without `complete.json` (written before markers existed) only needs
    DCP's `.metadata`: its final name alone proves the save finished.
    """
    if not ckpt_dir.is_dir():
        return f"{ckpt_dir} does not exist"
    if not (ckpt_dir / DCP_METADATA_FILENAME).is_file():
        return f"{ckpt_dir} has no {DCP_METADATA_FILENAME} (an incomplete save)"
    marker = ckpt_dir / COMPLETE_FILENAME
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text())["files"]
        expected = {str(name): int(size) for name, size in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{marker} is damaged ({type(e).__name__})"
    for name, size in expected.items():
        path = ckpt_dir / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is {actual} bytes but {size} were written (truncated or damaged)"
    return None


def make_tmp_dir_name(final_name: str, token: str) -> str:
    return f"{final_name}{_TMP_MARK}{token}"


def list_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations of the complete `iter_*` directories under `save_dir`, ascending."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for entry in save_dir.iterdir():
        iteration = _iteration_from_dirname(entry.name)
        if isinstance(iteration, int) and entry.is_dir():
            found.append(iteration)
    return sorted(found)


def prune_checkpoints(save_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest `iter_*` directories; never the tracker's target or `release`.

    Returns the deleted directories.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    save_dir = Path(save_dir)
    try:
        protected = read_tracker(save_dir)
    except CheckpointError:
        protected = None
    iterations = list_iterations(save_dir)
    keep = set(iterations[-keep_last:])
    removed = []
    for iteration in iterations:
        if iteration in keep or iteration == protected:
            continue
        path = save_dir / iteration_dirname(iteration)
        shutil.rmtree(path)
        removed.append(path)
    return removed


def remove_stale_tmp_dirs(save_dir: str | os.PathLike) -> list[Path]:
    """Delete leftovers of interrupted saves and replacements (`*.tmp-*`, `*.old-*`) under `save_dir`."""
    save_dir = Path(save_dir)
    removed = []
    if not save_dir.is_dir():
        return removed
    for entry in save_dir.iterdir():
        if _TMP_MARK in entry.name or _OLD_MARK in entry.name:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
