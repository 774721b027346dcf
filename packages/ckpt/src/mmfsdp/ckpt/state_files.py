"""The files of one training checkpoint directory (`iter_NNNNNNN/`) and the process helpers its readers and
writers share.

Beside DCP's own files a checkpoint holds `checkpoint.json` (format, iteration, world size, `has_optimizer`,
`trainable_only`, the caller's `metadata`), `app_state.pt` (global training state) and one `rank_<r>.pt` per
rank (RNG states and `rank_state`). DCP keys are `model.<name>` and `optimizer.*`. docs/checkpoints.md has the
whole layout.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from mmfsdp.ckpt.errors import CheckpointError

__all__ = [
    "MODEL_PREFIX",
    "OPTIMIZER_PREFIX",
    "INFO_FILENAME",
    "APP_STATE_FILENAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KeyMap",
    "rank_filename",
    "read_checkpoint_info",
    "load_tensor_file",
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


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist_on() else (0, 1)


def barrier() -> None:
    if dist_on():
        dist.barrier()


def read_checkpoint_info(path: str | os.PathLike) -> dict:
    """`checkpoint.json` of the checkpoint directory `path` ({} when it has none): iteration, world size,
    `has_optimizer`, `trainable_only` and the caller's `metadata`."""
    return read_info(Path(path))


def read_info(path: Path) -> dict:
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
