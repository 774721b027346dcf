"""One job, one voice, one log: a start-up error is printed once per job (under torchrun every rank reads the config;
only global rank 0 prints), and the app's launcher writes its console and every rank's to
`<output_dir>/logs/train_<time>.log`, named in the first line (docs/reliability.md, "One job, one voice, one log")."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import apprun
from tiny_resume import TINY, items, prepared_data

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


@pytest.mark.slow
def test_a_config_error_under_the_apps_launcher_is_printed_once(tmp_path):
    proc = apprun.attempt(apprun.command(TINY, {"bad.key": 1, "training.output_dir": tmp_path / "out"}), timeout=120)
    assert proc.returncode == 2
    assert [line for line in _output(proc) if line.strip()] == [
        "config error: bad: unknown key; valid keys here: parallel, data, model, features, training, tools"]
    assert not (tmp_path / "out").exists(), "no log file for a run that never started"


@pytest.mark.slow
def test_the_launcher_writes_its_console_and_every_ranks_to_one_log(tmp_path_factory, tmp_path):
    data = prepared_data(tmp_path_factory)
    out = tmp_path / "run"
    run_items = {**items(data, out), "training.train_iters": 2, "training.save_interval": 0}
    # as a user starts it: OMP_NUM_THREADS unset (the suite's conftest sets it for the tests' own processes)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = apprun.run(apprun.command(TINY, run_items), timeout=300, env=env, fresh=True)  # a fresh interpreter
    logs = sorted((out / "logs").iterdir())
    assert len(logs) == 1 and re.fullmatch(r"train_\d{8}_\d{6}\.log", logs[0].name), logs
    text = logs[0].read_text()
    first = proc.stdout.splitlines()[0]
    assert first.endswith(f"log: {logs[0]} (this console: the launcher and every rank)"), first
    assert text.splitlines()[0] == first, "the file starts with the line that names it"
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():  # everything on the console, in the file
        assert line in text, line
    steps = [json.loads(row)["step"] for row in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert re.search(r"step 2/2 \| loss ", text), "rank 0's step lines"
    # torchrun's one compute thread per rank, although the launcher had loaded torch (one thread per core) before it
    # set OMP_NUM_THREADS and forked them
    assert "torch intra-op threads per rank: 1 (OMP_NUM_THREADS=1)" in text, text[:3000]
    assert "evaluation" in text.lower() or "accuracy" in text.lower(), text[-2000:]
