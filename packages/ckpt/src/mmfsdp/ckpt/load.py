"""Load a training checkpoint (or converted `release` weights) into a model in place: `load_checkpoint`.

Collective. The model (and optimizer) are read through `dcp.load` + `set_state_dict`, which reshards when the
number of processes changed; names and shapes are checked first, tied aliases the checkpoint lacks are
dropped. Per-rank state (RNG, data position) is restored only at the world size that saved it. A
trainable-only checkpoint fills the trainable parameters alone; `key_map` loads weights stored under other
names. docs/checkpoints.md, "Resuming", says more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
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
from mmfsdp.ckpt.layout import RELEASE, resolve_checkpoint
from mmfsdp.ckpt.rng import restore_rng_state
from mmfsdp.ckpt.save import finalize_pending
from mmfsdp.ckpt.state_files import (
    APP_STATE_FILENAME,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    KeyMap,
    load_tensor_file,
    rank_filename,
    rank_world,
    read_info,
)

__all__ = ["load_checkpoint", "LoadedCheckpoint"]


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
    rank, world_size = rank_world()
    reader = SafeFileSystemReader(os.fspath(path))
    metadata = reader.read_metadata()
    has_optimizer = any(key.startswith(OPTIMIZER_PREFIX) for key in metadata.state_dict_metadata)
    with_optim = optimizer is not None and load_optim and iteration != RELEASE
    if with_optim and not has_optimizer:
        raise CheckpointError(
            f"checkpoint {path} has no optimizer state (saved with no_save_optim?); "
            "set no_load_optim to load the model only"
        )
    info = read_info(path)
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
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's read errors into one, raised on all
        raise CheckpointError(
            f"reading {path} failed: {_first_line(e)}; a data file is damaged. Restore it, or resume from "
            "an older checkpoint (training.resume_fallback, or point training.load at an iter_* directory)"
        ) from None
    if key_map is not None:  # back to the model's names (the same tensors, now loaded)
        model_sd = {key: value for key, value in own_sd.items() if stored[key] in model_sd}
    options = StateDictOptions(strict=not (dropped_aliases or trainable_only or key_map is not None))
    if with_optim:
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=state["optimizer"], options=options
        )
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
