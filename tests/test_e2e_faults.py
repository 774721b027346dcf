"""Faults around processes, through the real app (2 CPU ranks of examples/tiny): a SIGKILLed launcher leaves
no rank behind (ranks forked by the launcher, or started as fresh interpreters as on GPU hosts); a locked `training.save` stops a second run with one line, a stale lock is taken over; a
SIGSTOPped rank makes the others report where they wait and exit; an error every rank hits is printed once.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apprun
from apprun import ROOT, TINY
from mmfsdp.ckpt import LOCK_FILENAME
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

pytestmark = pytest.mark.slow


def _items(data: Path, out: Path, **extra) -> dict:
    return {
        **apprun.synthetic_items(data),
        **apprun.run_items(out, steps=10000),  # still running when the test acts
        "training.save": out / "ckpt",
        "training.save_interval": 0,
        **extra,
    }


def _command(data, out, **extra):
    return apprun.command(TINY, _items(data, out, **extra))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _rank_processes(launcher: int) -> list[int]:
    """The launcher's live rank processes (named `mmfsdp-rank<r>`; the launcher's log copier, `mmfsdp-log`, is not
    one)."""
    return [pid for pid in _children(launcher) if _alive(pid) and _comm(pid).startswith("mmfsdp-rank")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _rank_of(pid: int) -> int:
    """A rank's global rank, from the process name the app gives it (`mmfsdp-rank<r>`)."""
    return int(Path(f"/proc/{pid}/comm").read_text().strip().removeprefix("mmfsdp-rank"))


def _start_and_wait_for_step(cmd, out: Path, step: int, stderr=subprocess.DEVNULL):
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if any(r["step"] >= step for r in apprun.records(out)):
            return proc
        if proc.poll() is not None:
            pytest.fail("the run ended before the test could act")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no step {step} within 300 s")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    prepare_dataset(load_config(TINY, apprun.overrides(_items(tmp, tmp / "unused"))).data)
    return tmp


@pytest.mark.parametrize("rank_start", ["auto", "exec"])  # forked ranks (CPU hosts), fresh interpreters (GPU/NPU)
def test_sigkill_of_the_launcher_leaves_no_rank(data, tmp_path, rank_start):
    out = tmp_path / "run"
    proc = _start_and_wait_for_step(_command(data, out) + ["--rank-start", rank_start], out, 1)
    ranks = _rank_processes(proc.pid)
    assert len(ranks) == 2, ranks
    copier = [pid for pid in _children(proc.pid) if _comm(pid) == "mmfsdp-log"]
    assert len(copier) == 1, "the launcher's log copier"
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, as a scheduler cancelling the job would
        proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(pid) for pid in ranks + copier):
            time.sleep(0.1)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their launcher"
        assert not _alive(copier[0]), "the log copier ends when the last rank has closed its output"
    finally:
        for pid in ranks + copier:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (out / "ckpt" / LOCK_FILENAME).exists()  # left behind by the SIGKILL: the next run takes it over


def test_a_locked_save_directory_stops_a_second_run(data, tmp_path):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    since = "2026-12-02 10:00:00 UTC"
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": "first run"}
    (out / "ckpt" / LOCK_FILENAME).write_text(json.dumps(owner))
    proc = apprun.attempt(_command(data, out), timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"in use by another run (host {socket.gethostname()}, PID {os.getpid()}, since {since}" in lines[0]
    assert "wait for it to end, stop it, or choose another training.save" in lines[0]
    assert not (out / "metrics.jsonl").exists()
    assert json.loads((out / "ckpt" / LOCK_FILENAME).read_text()) == owner


def test_a_stale_lock_is_taken_over_and_an_error_on_every_rank_is_printed_once(data, tmp_path):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "ckpt" / LOCK_FILENAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    # One AdamW step at this lr moves every weight by ~lr: the next loss overflows on every rank, an error the
    # launcher's own check cannot see before the ranks start.
    diverge = {"training.lr": 1.0e30, "training.lr_min": 0.0, "training.lr_decay_style": "constant",
               "training.lr_warmup_ratio": 0.0}
    proc = apprun.attempt(_command(data, out, **diverge), timeout=300)
    assert proc.returncode == 1
    notices = [l for l in proc.stdout.splitlines() if "took over a stale lock" in l]
    assert len(notices) == 1 and f"PID {dead.pid} is not running" in notices[0], proc.stdout[-2000:]
    errors = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1, proc.stderr
    assert "is not finite at step " in errors[0] and "lower training.lr" in errors[0]
    assert proc.stderr.strip().splitlines()[-1].startswith("training failed: rank ")
    assert not (out / "ckpt" / LOCK_FILENAME).exists(), "the lock is released when the run ends"


def test_a_stopped_rank_makes_the_others_report_and_exit(data, tmp_path):
    out = tmp_path / "run"
    collective_timeout, heartbeat = 20, 10
    cmd = _command(data, out, **{"parallel.collective_timeout_s": collective_timeout,
                                 "parallel.heartbeat_timeout_s": heartbeat})
    proc = _start_and_wait_for_step(cmd, out, 2, stderr=subprocess.PIPE)
    ranks = {_rank_of(pid): pid for pid in _rank_processes(proc.pid)}
    assert sorted(ranks) == [0, 1]
    stopped = ranks[1]
    try:
        os.kill(stopped, signal.SIGSTOP)
        started = time.time()
        try:
            _, stderr = proc.communicate(timeout=collective_timeout + heartbeat + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the run did not end after a rank was stopped")
        took = time.time() - started
        assert took <= collective_timeout + heartbeat, f"the launcher ended {took:.0f} s after the stop"
        assert proc.returncode == 1
        assert not _alive(ranks[0]) and not _alive(stopped), "a rank outlived the run"
        waiting = [l for l in stderr.splitlines() if l.startswith("[rank 0] no progress for ")]
        assert len(waiting) == 1, stderr[-3000:]
        assert "waiting in " in waiting[0] and "called from " in waiting[0] and "in step " in waiting[0]
        report = (out / "hang_rank0.txt").read_text()
        assert report.startswith(waiting[0]) and "torch/distributed" in report
        assert "no progress: see hang_rank*.txt" in stderr
    finally:
        if _alive(stopped):
            os.kill(stopped, signal.SIGKILL)
