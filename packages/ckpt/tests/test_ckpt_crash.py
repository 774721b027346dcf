"""A process SIGKILLed at any point of a save leaves the tracker on the previous complete checkpoint.

The test runs this file as a script in a child process, which saves iteration 1,
then starts saving iteration 2 and blocks at a chosen point (mid-write inside
`dcp.save`, after DCP finished but before the directory rename, or after the
rename but before the tracker moves), announcing it through a file. The parent
kills it with SIGKILL there and checks what a restarted run sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmfsdp.ckpt import load_checkpoint, read_tracker, save_checkpoint

POINTS = ("mid_write", "before_rename", "before_tracker")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _block_forever(ready: Path) -> None:
    ready.write_text("ready")
    while True:
        time.sleep(1)


def _child(save_dir: Path, point: str, ready: Path) -> None:
    import torch.distributed.checkpoint as dcp

    import mmfsdp.ckpt.save as checkpoint_module

    model = _model()
    save_checkpoint(save_dir, 1, model=model)
    with torch.no_grad():
        model[0].weight.add_(1.0)

    if point == "mid_write":
        class StallingWriter(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                future = super().write_data(plan, planner)
                future.wait()  # data files are on disk, .metadata is not
                _block_forever(ready)

        checkpoint_module.FileSystemWriter = StallingWriter
    else:
        real_rename, real_replace = os.rename, os.replace

        def rename(src, dst, *args, **kwargs):
            if point == "before_rename" and ".tmp-" in os.fspath(src):
                _block_forever(ready)
            return real_rename(src, dst, *args, **kwargs)

        def replace(src, dst, *args, **kwargs):
            if point == "before_tracker" and Path(dst).name == "latest_checkpointed_iteration.txt":
                _block_forever(ready)
            return real_replace(src, dst, *args, **kwargs)

        os.rename, os.replace = rename, replace
    save_checkpoint(save_dir, 2, model=model)
    raise AssertionError("the save should have blocked")


@pytest.mark.slow  # a fresh interpreter per crash point
@pytest.mark.parametrize("point", POINTS)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, point):
    save_dir, ready = tmp_path / "ckpt", tmp_path / "ready"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, str(save_dir), point, str(ready)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            if proc.poll() is not None:
                raise AssertionError(f"child exited early:\n{proc.stdout.read().decode()}")
            assert time.monotonic() < deadline, "child never reached the kill point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    assert read_tracker(save_dir) == 1
    assert (save_dir / "iter_0000002").is_dir() == (point == "before_tracker")
    restarted = _model()
    with torch.no_grad():
        restarted[0].weight.zero_()
    assert load_checkpoint(save_dir, model=restarted).iteration == 1
    expected = _model().state_dict()
    for key, value in restarted.state_dict().items():
        assert torch.equal(value, expected[key]), key

    # the restarted run saves again; leftovers of the killed save are cleared
    save_checkpoint(save_dir, 2, model=restarted)
    assert read_tracker(save_dir) == 2
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


if __name__ == "__main__":
    torch.set_num_threads(1)
    _child(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
