"""Rank-0 logging for `mmfsdp.ckpt` without depending on `mmfsdp.config`.

Records go to the `mmfsdp.ckpt` logger, a child of the `mmfsdp` logger that the
trainer configures; warnings are logged once per process.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

logger = logging.getLogger("mmfsdp.ckpt")
_warned: set[str] = set()


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def info_rank0(message: str) -> None:
    if _rank() == 0:
        logger.info(message)


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("WARNING: %s", message)
