"""The one exception type `mmfsdp.ckpt` raises for bad input (paths, files, keys, shapes), and `preview`, the
short list of keys its messages show."""

from __future__ import annotations

from typing import Sequence

__all__ = ["CheckpointError", "preview"]


class CheckpointError(Exception):
    """A checkpoint or weights directory is missing, incomplete or does not match the model.

    The message says what is wrong and what to do next; `mm-convert` prints it
    without a traceback.
    """


def preview(items: Sequence[str], limit: int = 10) -> str:
    """The first `limit` of `items`, comma-separated, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
