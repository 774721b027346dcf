"""Output directories of the converters (`mm-convert`, LoRA exports): refuse an unusable or overlapping
`--save_dir`, write into a `.tmp-` directory beside it, publish it with `layout.publish_dir` (the one safe
publish of every writer: the old directory renamed aside, the new one renamed in, the parent fsynced), and
copy a model's non-weight files (config, tokenizer, processor) next to exported weights."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Sequence

from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.layout import publish_dir

__all__ = [
    "check_output_dir",
    "copy_model_assets",
    "discard_output_dir",
    "prepare_output_dir",
    "publish_output_dir",
    "refuse_overlap",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".distcp")
"""Weight files a model directory may hold; `copy_model_assets` leaves them out."""


def check_output_dir(path: Path, force: bool, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{flag} {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise CheckpointError(f"{flag} {path} is not empty; choose an empty directory or pass --force to replace it")


def refuse_overlap(output: str | os.PathLike, out_flag: str, inputs: Sequence[tuple[str | os.PathLike, str]]) -> None:
    """Refuse an output directory that is, holds or lies inside an input directory (symlinks and `..` resolved).

    Writing there would replace or mix with what is being read (`--force` or not).
    """
    out = Path(output).expanduser().resolve()
    for path, flag in inputs:
        src = Path(path).expanduser().resolve()
        if out == src:
            how = "is the same directory as"
        elif out.is_relative_to(src):
            how = "is inside"
        elif src.is_relative_to(out):
            how = "contains"
        else:
            continue
        raise CheckpointError(f"{out_flag} {output} {how} {flag} {path}; choose an output directory outside every input (--force does not change this)")


def prepare_output_dir(
    save_dir: Path, force: bool, flag: str, inputs: Sequence[tuple[str | os.PathLike, str]] = ()
) -> Path:
    """Check `save_dir` (`refuse_overlap` with `inputs`, `check_output_dir`) and create the `.tmp-` directory
    beside it that the output is written into; publish it with `publish_output_dir`."""
    refuse_overlap(save_dir, flag, inputs)
    check_output_dir(save_dir, force, flag)
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = save_dir.parent / f".{save_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp_dir.mkdir()
    return tmp_dir


def publish_output_dir(tmp_dir: Path, save_dir: Path) -> Path:
    """Publish a finished `prepare_output_dir` directory as `save_dir` (`layout.publish_dir`)."""
    publish_dir(tmp_dir, save_dir)
    return save_dir


def discard_output_dir(tmp_dir: Path) -> None:
    """Remove an unfinished `prepare_output_dir` directory."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


def copy_model_assets(assets: Path, out: Path) -> list[str]:
    """Copy the non-weight files of the model directory `assets` into `out`; their names."""
    copied = []
    for entry in sorted(assets.iterdir()):
        if not entry.is_file() or entry.name.startswith("."):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or entry.name.endswith(".index.json"):
            continue
        shutil.copy2(entry, out / entry.name)
        copied.append(entry.name)
    return copied
