"""The one exception type `mmfsdp.ckpt` raises for bad input (paths, files, keys, shapes)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(Exception):
    """A checkpoint or weights directory is missing, incomplete or does not match the model.

    The message says what is wrong and what to do next; `mm-convert` prints it
    without a traceback.
    """
