"""Fixtures for mmfsdp.ckpt tests: a multi-process gloo launcher, and toy state-dict adapters installed as entry
points."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

TOY_ADAPTERS = Path(__file__).with_name("ckpt_toy_adapters.py")


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo processes; return per-rank values.

    The ranks fork from the forkserver of `mmfsdp.parallel.testing` (torch, FSDP2 and DCP imported once; a
    test-only dependency of this package, its dev group), each a fresh process with its own process group. A
    failure on any rank stops the others and raises with that rank's traceback.
    """
    from mmfsdp.parallel.testing import run_distributed

    def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
        return run_distributed(fn, world_size, *args, timeout=timeout)

    return run


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def toy_adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install `ckpt_toy_adapters` as a distribution whose entry points register `toy_prefix` and `toy_moe`.

    A `*.dist-info` directory on `sys.path` is what `importlib.metadata` reads for any installed
    package, so discovery runs exactly as for a model package. Returns the directory (for PYTHONPATH).
    """
    root = tmp_path / "plugins"
    info = root / "ckpt_toy_adapters-0.1.dist-info"
    info.mkdir(parents=True)
    shutil.copy(TOY_ADAPTERS, root / TOY_ADAPTERS.name)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckpt-toy-adapters\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[mmfsdp.state_dict_adapters]\n"
        "toy_prefix = ckpt_toy_adapters:ToyPrefixAdapter\n"
        "toy_moe = ckpt_toy_adapters:ToyMoEAdapter\n"
    )
    monkeypatch.syspath_prepend(os.fspath(root))
    return root
