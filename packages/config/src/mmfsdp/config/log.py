"""One logger for every mmfsdp package: info on rank 0 only, warnings once.

The rank is read from `torch.distributed` when a process group is up, else from
the `RANK` environment variable that torchrun sets, so this module works in
packages that never import torch.
"""

from __future__ import annotations

import logging
import os
import sys

_warned: set[str] = set()
_configured = False


def current_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or current_rank() == 0


def get_logger(name: str = "mmfsdp") -> logging.Logger:
    """A logger under `mmfsdp` that prints INFO and WARNING on rank 0 only (errors on every rank)."""
    global _configured
    root = logging.getLogger("mmfsdp")
    if not _configured:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        handler.addFilter(_RankZeroFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
        _configured = True
    return root if name == "mmfsdp" else root.getChild(name.removeprefix("mmfsdp."))


def warn_once(message: str, logger: logging.Logger | None = None) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message in _warned:
        return
    _warned.add(message)
    (logger or get_logger()).warning("WARNING: %s", message)
