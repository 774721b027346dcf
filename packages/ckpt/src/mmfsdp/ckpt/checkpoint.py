"""Save and resume training state with PyTorch Distributed Checkpoint (DCP).

Save (`save_checkpoint`, collective: every rank calls it with the same arguments)
1. Wait for a pending async save (`finalize_pending`).
2. Rank 0 creates `<save>/iter_NNNNNNN.tmp-<token>/` (removing leftovers of
   interrupted saves first); the token is broadcast so all ranks use one directory,
   and a failure of rank 0's file operations is raised on every rank.
3. Every rank writes `rank_<r>.pt` (its RNG states and `rank_state`); rank 0
   writes `app_state.pt` and `checkpoint.json` (iteration, world size).
4. Model (+ optimizer) state from `torch.distributed.checkpoint.state_dict.get_state_dict`
   goes through `dcp.save` (or `dcp.async_save` on a dedicated gloo group, so the
   background thread's collectives never interleave with training's).
5. After every rank has finished (a barrier; for async saves the completion of
   DCP's own final gather on rank 0), rank 0 writes `complete.json` (every file
   and its size), renames the directory to `iter_NNNNNNN`, atomically rewrites
   the tracker, then prunes to `keep_last`.

Resume (`find_resume_point`, collective) picks the checkpoint a run continues
from: the tracker's iteration once `verify_checkpoint` found it whole on every
rank; without a tracker, the newest whole `iter_*`; a damaged one is an error
naming the file, or (`fallback=True`) the newest whole older one, never silence.

Load (`load_checkpoint`, collective) resolves the tracker, loads the model (and the
optimizer) in place through `dcp.load` + `set_state_dict`, which reshards when the
number of processes changed, and returns the global `app_state` and this rank's
`rank_state`. Per-rank state (RNG, data position) is only restored when the
world size is the one the checkpoint was saved with.

DCP keys are `model.<name>` for every entry of the model's `state_dict()` and
`optimizer.state.<name>.<slot>` / `optimizer.param_groups.*` for the optimizer
(DCP's flattening of `get_state_dict`'s output). With FSDP2 the entries are
DTensors and each rank writes and reads only its shards.

Trainable-only checkpoints (`save_checkpoint(trainable_only=True)`, e.g. LoRA
adapters on a frozen base) leave out every parameter with `requires_grad=False`
and say so in `checkpoint.json` (`"trainable_only": true`). Loading one fills only
the model's trainable parameters (and the optimizer): the frozen ones are the
caller's to load first, from the weights the run started from. `key_map` lets a
caller load weights stored under other names (`x.weight` into a wrapped layer's
`x.base_layer.weight`) or leave keys out that the checkpoint does not hold.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mmfsdp.ckpt._log import info_rank0, warn_once
from mmfsdp.ckpt.dcp_io import SafeFileSystemReader, SafeLoadPlanner, quiet_single_process
from mmfsdp.ckpt.errors import CheckpointError, preview
from mmfsdp.ckpt.layout import (
    RELEASE,
    TRACKER_FILENAME,
    check_complete,
    iteration_dirname,
    list_iterations,
    make_tmp_dir_name,
    prune_checkpoints,
    publish_dir,
    read_tracker,
    remove_stale_tmp_dirs,
    resolve_checkpoint,
    write_complete_marker,
    write_tracker,
)
from mmfsdp.ckpt.rng import capture_rng_state, restore_rng_state

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "finalize_pending",
    "SaveHandle",
    "LoadedCheckpoint",
    "ResumePoint",
    "find_resume_point",
    "verify_checkpoint",
    "load_tensor_file",
    "read_checkpoint_info",
    "KeyMap",
]

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."
INFO_FILENAME = "checkpoint.json"
APP_STATE_FILENAME = "app_state.pt"
FORMAT_NAME = "mmfsdp-dcp"
FORMAT_VERSION = 1

KeyMap = Callable[[str], "str | None"]
"""A model `state_dict()` key -> the key it is stored under (None: not stored there; the caller fills it)."""


def rank_filename(rank: int) -> str:
    return f"rank_{rank}.pt"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _on_rank0(rank: int, fn: Any) -> None:
    """Run `fn` on rank 0 and raise its error on every rank, so no rank waits for a failed one."""
    error = None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # re-raised below on every rank
            error = f"{type(e).__name__}: {e}"
    if _dist_on():
        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error is not None:
        raise CheckpointError(f"rank 0 failed while saving a checkpoint: {error}")


def _broadcast_token() -> str:
    token = [uuid.uuid4().hex[:8]]
    if _dist_on():
        dist.broadcast_object_list(token, src=0)
    return token[0]


_async_groups: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group for DCP's background-thread collectives (created once, collectively)."""
    if not _dist_on():
        return None
    key = id(dist.group.WORLD)
    if key not in _async_groups:
        _async_groups[key] = dist.new_group(backend="gloo")
    return _async_groups[key]


def _serialise(obj: Any, what: str) -> bytes:
    """torch.save `obj`, checking that `torch.load(weights_only=True)` gives it back."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        data = buffer.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # the pickler's / unpickler's own error names the offending type
        raise CheckpointError(
            f"{what} cannot be reloaded with torch.load(weights_only=True): {e}\n"
            "Store only tensors, numbers, strings, None and lists/tuples/dicts of them "
            "(convert NumPy arrays with torch.from_numpy; RNG states are captured by save_checkpoint itself)."
        ) from None
    return data


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class SaveHandle:
    """A save in flight (async) or finished. `wait()` blocks until the checkpoint is published."""

    def __init__(self, iteration: int, path: Path, future: Any | None = None, finalize: Any | None = None) -> None:
        self.iteration = iteration
        self.path = path
        self._future = future
        self._finalized = threading.Event()
        self._error: BaseException | None = None
        if future is None:
            self._finalized.set()
        else:
            future.add_done_callback(lambda fut: self._complete(fut, finalize))

    def _complete(self, future: Any, finalize: Any | None) -> None:
        try:
            future.result()
            if finalize is not None:
                finalize()
        except BaseException as e:  # re-raised by wait() in the caller's thread
            self._error = e
        finally:
            self._finalized.set()

    def done(self) -> bool:
        """True once the save (and, on rank 0, the publication) has finished or failed."""
        return self._finalized.is_set()

    def wait(self) -> Path:
        """Block until published; return the final checkpoint path. Raises the save's error."""
        self._finalized.wait()
        if self._error is not None:
            raise CheckpointError(f"async save of {self.path} failed: {self._error!r}") from self._error
        return self.path


_pending: SaveHandle | None = None


def finalize_pending() -> Path | None:
    """Wait until the pending async save, if any, is published on rank 0; return its path.

    Collective when a save is pending (all ranks have one): it ends with a
    barrier, so afterwards every rank sees the moved tracker. Call it before the
    process group is destroyed; `save_checkpoint` and `load_checkpoint` call it.
    """
    global _pending
    handle, _pending = _pending, None
    if handle is None:
        return None
    try:
        return handle.wait()
    finally:
        _barrier()


def _publish(save_dir: Path, tmp_dir: Path, iteration: int, keep_last: int | None) -> None:
    final_dir = save_dir / iteration_dirname(iteration)
    write_complete_marker(tmp_dir)
    publish_dir(tmp_dir, final_dir)
    write_tracker(save_dir, iteration)
    if keep_last is not None:
        for path in prune_checkpoints(save_dir, keep_last):
            info_rank0(f"removed old checkpoint {path}")
    info_rank0(f"saved checkpoint {final_dir}")


def _state_for_save(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
) -> dict[str, Any]:
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def _json_metadata(metadata: dict | None) -> dict:
    try:
        return json.loads(json.dumps(dict(metadata or {})))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata must be JSON (numbers, strings, lists, dicts): {e}") from None


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    app_state: dict | None = None,
    rank_state: dict | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
    trainable_only: bool = False,
    metadata: dict | None = None,
) -> SaveHandle:
    """Save `<save_dir>/iter_{iteration:07d}` and move the tracker to it once complete.

    Collective. `optimizer=None` saves the model only (`no_save_optim`).
    `app_state` must be identical on all ranks (scheduler, counters, global data
    position); `rank_state` is this rank's own (e.g. its loader state). Both must
    round-trip through `torch.load(weights_only=True)`. This rank's RNG states
    are saved with `rank_state`. With `async_save`, the state is staged to CPU
    memory before this returns and written in the background; the checkpoint is
    published when that finishes (see `SaveHandle.wait` and `finalize_pending`).
    `keep_last` keeps only that many newest `iter_*` directories.
    `trainable_only` leaves out the frozen parameters (`requires_grad=False`): the
    checkpoint then holds the trainable ones, buffers and the optimizer, and says so
    in `checkpoint.json`. `metadata` (JSON) is stored there too, under "metadata".
    """
    finalize_pending()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    name = iteration_dirname(iteration)
    if iteration == RELEASE:
        raise ValueError("save_checkpoint saves training iterations; `release` is written by mm-convert")
    rank, world_size = _rank_world()
    save_dir = Path(save_dir)
    app_bytes = _serialise(dict(app_state or {}), "app_state")
    rank_bytes = _serialise({"rank": rank, "rng": capture_rng_state(), "state": rank_state}, f"rank_state (rank {rank})")
    metadata = _json_metadata(metadata)

    tmp_dir = save_dir / make_tmp_dir_name(name, _broadcast_token())

    def prepare() -> None:
        save_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp_dirs(save_dir)
        tmp_dir.mkdir()

    _on_rank0(rank, prepare)  # ends with a broadcast: the directory exists for every rank
    _write_bytes(tmp_dir / rank_filename(rank), rank_bytes)
    if rank == 0:
        _write_bytes(tmp_dir / APP_STATE_FILENAME, app_bytes)
        info = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "iteration": iteration,
                "world_size": world_size, "has_optimizer": optimizer is not None, "trainable_only": trainable_only}
        if metadata:
            info["metadata"] = metadata
        _write_bytes(tmp_dir / INFO_FILENAME, json.dumps(info, indent=1).encode())

    state = _state_for_save(model, optimizer, trainable_only)
    final_dir = save_dir / name
    if not async_save:
        with quiet_single_process():
            dcp.save(state, storage_writer=FileSystemWriter(tmp_dir))
        _barrier()
        _on_rank0(rank, lambda: _publish(save_dir, tmp_dir, iteration, keep_last))
        return SaveHandle(iteration, final_dir)

    global _pending
    # The writer stages the state into fresh CPU copies before async_save returns (tested), so
    # training may update parameters at once.
    response = dcp.async_save(state, storage_writer=FileSystemWriter(tmp_dir), process_group=_async_group())
    future = getattr(response, "upload_completion", response)
    finalize = (lambda: _publish(save_dir, tmp_dir, iteration, keep_last)) if rank == 0 else None
    _pending = SaveHandle(iteration, final_dir, future, finalize)
    return _pending


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored."""

    iteration: int | str
    """The iteration loaded, or "release" for converted weights."""
    path: Path
    """The checkpoint directory that was read."""
    app_state: dict
    """The global state saved with `app_state` ({} for release)."""
    rank_state: dict | None
    """This rank's `rank_state`; None for release or when the world size changed."""
    saved_world_size: int | None
    """Number of processes that saved it (None when unknown, e.g. release)."""
    rng_restored: bool
    """Whether this rank's RNG states were restored."""


def _alias_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict keys that name the same tensor (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            by_id.setdefault(id(value), []).append(key)
    return [keys for keys in by_id.values() if len(keys) > 1]


def _check_model_keys(
    aliases: list[list[str]], model_sd: dict[str, Any], metadata: Any, path: Path, trainable_only: bool
) -> bool:
    """Validate names and shapes against the checkpoint; drop tied aliases it lacks. True if any were dropped."""
    saved = metadata.state_dict_metadata
    dropped = False
    for group in aliases:
        present = [key for key in group if MODEL_PREFIX + key in saved]
        if present:
            for key in group:
                if key not in present and key in model_sd:
                    del model_sd[key]
                    dropped = True
    missing = [key for key in model_sd if MODEL_PREFIX + key not in saved]
    mismatched = []
    for key, value in model_sd.items():
        entry = saved.get(MODEL_PREFIX + key)
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(value.shape) != tuple(entry.size):
                mismatched.append(f"{key}: model {tuple(value.shape)}, checkpoint {tuple(entry.size)}")
    if missing or mismatched:
        lines = []
        if missing:
            lines.append(f"{len(missing)} model keys missing from the checkpoint: {preview(missing)}")
        if mismatched:
            lines.append(f"{len(mismatched)} shape mismatches: {preview(mismatched)}")
        what = (" It holds only the trainable parameters of the run that saved it (e.g. LoRA adapters): train the "
                "same ones (the same training.lora)." if trainable_only else "")
        raise CheckpointError(
            f"checkpoint {path} does not match the model:\n  " + "\n  ".join(lines)
            + f"\nCheck that the model config matches the one the checkpoint was saved or converted from.{what}"
        )
    return dropped


def _first_line(error: BaseException) -> str:
    """A short description of `error`: DCP's gathered exceptions carry whole tracebacks."""
    for line in str(error).splitlines():
        line = line.strip()
        if "Weights only load failed" in line:  # torch's advice to lift the restriction is never passed on
            return "a tensor file is damaged or holds Python objects (never loaded)"
        if line and not line.startswith(("Traceback", "File ", "^")) and "Error" in line:
            return line[:300]
    text = str(error).strip().splitlines()
    return (text[0][:300] if text else "") or type(error).__name__


def read_checkpoint_info(path: str | os.PathLike) -> dict:
    """`checkpoint.json` of the checkpoint directory `path` ({} when it has none): iteration, world size,
    `has_optimizer`, `trainable_only` and the caller's `metadata`."""
    return _read_info(Path(path))


def _read_info(path: Path) -> dict:
    info_path = path / INFO_FILENAME
    if not info_path.is_file():
        return {}
    try:
        return json.loads(info_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{info_path} is not valid JSON ({e}); the checkpoint is damaged") from None


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def load_tensor_file(path: Path, what: str) -> Any:
    """`torch.load(path, weights_only=True)` with a one-line `CheckpointError` for a damaged or foreign file.

    A file that holds arbitrary Python objects is refused, and the message never
    suggests lifting the restriction: mmfsdp writes only tensors and plain containers.
    """
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path} ({what}) is missing; the checkpoint is incomplete") from None
    except pickle.UnpicklingError as e:
        found = _GLOBAL_RE.search(str(e))
        detail = f" (it references {found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} ({what}) is not a tensor file written by mmfsdp{detail}: it holds Python objects, "
            "which are never loaded; restore the file from a copy or resume from another checkpoint"
        ) from None
    except Exception as e:  # torch raises RuntimeError / EOFError / zip errors for damaged files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} ({what}) is damaged and cannot be read ({first}); "
            "restore it from a copy or resume from another checkpoint"
        ) from None


def _agree(problem: str | None) -> str | None:
    """The first problem any rank found (rank order), the same on every rank."""
    if not _dist_on():
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
    rank, world_size = _rank_world()
    problem = check_complete(path)
    if problem is None:
        try:
            SafeFileSystemReader(os.fspath(path)).read_metadata()
            info = _read_info(path)
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
                raise CheckpointError(f"{e}; or set training.resume_fallback: true to resume from the newest whole checkpoint") from None
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
                return ResumePoint(path, iteration, f"{damaged}; falling back to {path.name} (training.resume_fallback)")
        raise CheckpointError(f"cannot resume from {save_dir}: {damaged}, and no older checkpoint is whole")
    if not iterations:
        return None
    problems = []
    for iteration in reversed(iterations):
        path = save_dir / iteration_dirname(iteration)
        problem = verify_checkpoint(path)
        if problem is None:
            return ResumePoint(path, iteration, f"{tracker} is missing; resuming from the newest whole checkpoint {path.name}")
        problems.append(problem)
    raise CheckpointError(
        f"{save_dir} holds iter_* checkpoints but none is whole ({problems[0]}); "
        "restore them, or move them away to start the run over"
    )


def load_checkpoint(
    load_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    load_optim: bool = True,
    load_rng: bool = True,
    key_map: KeyMap | None = None,
) -> LoadedCheckpoint:
    """Load the checkpoint `load_dir`'s tracker names (or `load_dir` itself if it is iter_*/release).

    Collective. Loads in place into `model` (plain or FSDP2, already materialised)
    and, unless `load_optim` is False or the checkpoint is `release`, `optimizer`.
    Restores this rank's RNG states when `load_rng` and the world size is unchanged.
    A trainable-only checkpoint fills only the trainable parameters (load the frozen
    ones first). `key_map` gives the stored name of each model key (None: not loaded).
    """
    finalize_pending()
    path, iteration = resolve_checkpoint(load_dir)
    on_meta = [name for name, value in model.state_dict(keep_vars=True).items() if value.is_meta]
    if on_meta:
        raise CheckpointError(
            f"{len(on_meta)} model tensors are on the meta device ({preview(on_meta)}); "
            "materialise the model first, e.g. model.to_empty(device=...)"
        )
    rank, world_size = _rank_world()
    reader = SafeFileSystemReader(os.fspath(path))
    metadata = reader.read_metadata()
    has_optimizer = any(key.startswith(OPTIMIZER_PREFIX) for key in metadata.state_dict_metadata)
    with_optim = optimizer is not None and load_optim and iteration != RELEASE
    if with_optim and not has_optimizer:
        raise CheckpointError(
            f"checkpoint {path} has no optimizer state (saved with no_save_optim?); "
            "set no_load_optim to load the model only"
        )
    info = _read_info(path)
    trainable_only = bool(info.get("trainable_only", False))
    read_options = StateDictOptions(ignore_frozen_params=trainable_only)
    if with_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=read_options)
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=read_options), None
    aliases = _alias_groups(model)
    own_sd = model_sd
    stored = {key: key if key_map is None else key_map(key) for key in model_sd}
    if key_map is not None:
        aliases = [[stored[k] for k in group if stored.get(k) is not None] for group in aliases]
        model_sd = {stored[key]: value for key, value in model_sd.items() if stored[key] is not None}
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optimizer": optim_sd}
    dropped_aliases = _check_model_keys(aliases, model_sd, metadata, path, trainable_only)
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's read errors into one exception, raised on all ranks
        raise CheckpointError(
            f"reading {path} failed: {_first_line(e)}; a data file is damaged. Restore it, or resume from "
            "an older checkpoint (training.resume_fallback, or point training.load at an iter_* directory)"
        ) from None
    if key_map is not None:  # back to the model's names (the same tensors, now loaded)
        model_sd = {key: value for key, value in own_sd.items() if stored[key] in model_sd}
    options = StateDictOptions(strict=not (dropped_aliases or trainable_only or key_map is not None))
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=state["optimizer"], options=options)
    else:
        set_model_state_dict(model, model_sd, options=options)

    saved_world_size = info.get("world_size")
    app_state: dict = {}
    rank_state = None
    rng_restored = False
    if iteration != RELEASE:
        app_path = path / APP_STATE_FILENAME
        if app_path.is_file():
            app_state = load_tensor_file(app_path, "global training state")
        if saved_world_size == world_size:
            payload = load_tensor_file(path / rank_filename(rank), f"rank {rank} state")
            rank_state = payload["state"]
            if load_rng:
                restore_rng_state(payload["rng"])
                rng_restored = True
        else:
            warn_once(
                f"checkpoint {path} was saved by {saved_world_size} processes, this run has {world_size}: "
                "model and optimizer are resharded, per-rank state (RNG, data position) is not restored "
                "(see docs/checkpoints.md, 'Changing the number of processes')"
            )
    what = "model + optimizer" if with_optim else "model"
    info_rank0(f"loaded {what} from {path} (iteration {iteration})")
    return LoadedCheckpoint(iteration, path, app_state, rank_state, saved_world_size, rng_restored)
