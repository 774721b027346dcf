"""One job, one voice: a start-up error is printed once per job (under torchrun every rank reads the config; only
global rank 0 prints) (docs/reliability.md, "One job, one voice, one log")."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import apprun
from tiny_resume import TINY

ROOT = apprun.ROOT
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _output(proc: subprocess.CompletedProcess) -> list[str]:
    return (proc.stdout + proc.stderr).splitlines()


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", str(apprun.APP), str(TINY), "bad.key=1",
           f"training.output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    errors = [line for line in _output(proc) if "config error" in line]
    assert errors == ["config error: bad: unknown key; valid keys here: parallel, data, model, features, training, "
                      "tools"], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode != 0
    assert re.search(r"exitcode\s*: 2 ", proc.stderr), "rank 0 exits with the config-error code"
    assert not (tmp_path / "out").exists()


def test_a_config_error_under_the_apps_launcher_is_printed_once(tmp_path):
    proc = subprocess.run(apprun.command(TINY, {"bad.key": 1, "training.output_dir": tmp_path / "out"}),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert [line for line in _output(proc) if line.strip()] == [
        "config error: bad: unknown key; valid keys here: parallel, data, model, features, training, tools"]
    assert not (tmp_path / "out").exists(), "no log file for a run that never started"
