"""Save training state with PyTorch Distributed Checkpoint (DCP): `save_checkpoint`, `finalize_pending`.

Collective: every rank calls `save_checkpoint` with the same arguments. The state is written into
`<save>/iter_NNNNNNN.tmp-<token>/`, published (`layout.publish_dir`) once every rank has finished and
`complete.json` lists its files, and only then does the tracker move; `async_save` writes in the background on
a gloo group of its own. The steps, the files and the trainable-only variant: docs/checkpoints.md, "Saving".
"""

from __future__ import annotations

import io
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from mmfsdp.ckpt._log import info_rank0
from mmfsdp.ckpt.dcp_io import quiet_single_process
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.layout import (
    RELEASE,
    iteration_dirname,
    make_tmp_dir_name,
    prune_checkpoints,
    publish_dir,
    remove_stale_tmp_dirs,
    write_complete_marker,
    write_tracker,
)
from mmfsdp.ckpt.rng import capture_rng_state
from mmfsdp.ckpt.state_files import (
    APP_STATE_FILENAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    INFO_FILENAME,
    barrier,
    dist_on,
    rank_filename,
    rank_world,
)

__all__ = ["save_checkpoint", "finalize_pending", "SaveHandle"]


def _on_rank0(rank: int, fn: Any) -> None:
    """Run `fn` on rank 0 and raise its error on every rank, so no rank waits for a failed one."""
    error = None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # re-raised below on every rank
            error = f"{type(e).__name__}: {e}"
    if dist_on():
        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error is not None:
        raise CheckpointError(f"rank 0 failed while saving a checkpoint: {error}")


def _broadcast_token() -> str:
    token = [uuid.uuid4().hex[:8]]
    if dist_on():
        dist.broadcast_object_list(token, src=0)
    return token[0]


_async_groups: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group for DCP's background-thread collectives (created once, collectively)."""
    if not dist_on():
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
        barrier()


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
    rank, world_size = rank_world()
    save_dir = Path(save_dir)
    app_bytes = _serialise(dict(app_state or {}), "app_state")
    rank_payload = {"rank": rank, "rng": capture_rng_state(), "state": rank_state}
    rank_bytes = _serialise(rank_payload, f"rank_state (rank {rank})")
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
        barrier()
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
