"""Fixtures for mmfsdp.ckpt tests: a multi-process gloo launcher (torch and the standard library only), and toy
state-dict adapters installed as entry points."""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

WORKER = Path(__file__).with_name("ckpt_worker.py")
TOY_ADAPTERS = Path(__file__).with_name("ckpt_toy_adapters.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(fn: Callable[..., Any], world_size: int, *args: Any, workdir: Path, timeout: float = 180.0) -> list[Any]:
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo processes; return per-rank values.

    A failure on any rank kills the others and raises with that rank's traceback.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    args_path = workdir / f"args-{fn.__name__}.pkl"
    args_path.write_bytes(pickle.dumps(args))
    prefix = workdir / f"result-{fn.__name__}"
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(WORKER), fn.__code__.co_filename, fn.__name__, str(args_path), str(prefix)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, proc in enumerate(procs):
                if proc.poll() is None:
                    continue
                result = Path(f"{prefix}.{rank}")
                if not result.exists():
                    failure = f"rank {rank} exited with code {proc.returncode} without a result"
                elif pickle.loads(result.read_bytes())[0] == "error":
                    failure = f"rank {rank} failed:\n{pickle.loads(result.read_bytes())[1]}"
            if failure or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        outputs = [proc.communicate()[0].decode(errors="replace") for proc in procs]
    values = []
    for rank in range(world_size):
        result = Path(f"{prefix}.{rank}")
        if not result.exists():
            reason = failure or f"rank {rank} exited with {procs[rank].returncode} and no result (timeout {timeout}s?)"
            raise AssertionError(f"{reason}\n--- rank {rank} output ---\n{outputs[rank][-4000:]}")
        status, payload = pickle.loads(result.read_bytes())
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{payload}")
        values.append(payload)
    return values


@pytest.fixture
def run_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
        return launch_ranks(fn, world_size, *args, workdir=tmp_path / "ranks", timeout=timeout)

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
