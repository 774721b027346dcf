import json
import os
import socket
import subprocess
import sys

import pytest

from mmfsdp.ckpt import LOCK_FILENAME, CheckpointError, SaveDirLock
from mmfsdp.ckpt.lock import pid_alive, process_start_ticks


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_owner(save, **fields):
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": "2026-01-01 00:00:00 UTC",
             "command": "other run", "start_ticks": process_start_ticks(os.getpid())}
    owner.update(fields)
    (save / LOCK_FILENAME).write_text(json.dumps(owner))


def test_ckpt_lock_acquire_writes_owner_and_release_removes_it(tmp_path):
    save = tmp_path / "save"
    lock = SaveDirLock(save, command=["train", "cfg.yaml"])
    assert lock.acquire() is None
    owner = json.loads((save / LOCK_FILENAME).read_text())
    assert owner["host"] == socket.gethostname() and owner["pid"] == os.getpid()
    assert owner["command"] == "train cfg.yaml" and owner["start_ticks"] == process_start_ticks(os.getpid())
    assert sorted(p.name for p in save.iterdir()) == [LOCK_FILENAME]  # no temporary file left
    lock.release()
    lock.release()
    assert not (save / LOCK_FILENAME).exists()


def test_ckpt_lock_held_by_a_live_run_refuses_with_one_line(tmp_path):
    with SaveDirLock(tmp_path):
        with pytest.raises(CheckpointError) as info:
            SaveDirLock(tmp_path).acquire()
    message = str(info.value)
    assert "\n" not in message
    assert f"host {socket.gethostname()}, PID {os.getpid()}, since " in message
    assert "wait for it to end" in message
    assert not (tmp_path / LOCK_FILENAME).exists()


def test_ckpt_lock_stale_dead_pid_is_taken_over(tmp_path):
    dead = _dead_pid()
    assert not pid_alive(dead)
    _write_owner(tmp_path, pid=dead)
    lock = SaveDirLock(tmp_path)
    notice = lock.acquire()
    assert notice is not None and "\n" not in notice
    assert f"took over a stale lock on {tmp_path}" in notice and f"PID {dead} is not running" in notice
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILENAME]
    lock.release()


def test_ckpt_lock_reused_pid_is_stale(tmp_path):
    _write_owner(tmp_path, start_ticks=process_start_ticks(os.getpid()) - 1)
    notice = SaveDirLock(tmp_path).acquire()
    assert "now belongs to a different process" in notice


def test_ckpt_lock_from_another_host_is_never_taken_over(tmp_path):
    _write_owner(tmp_path, host="other-node-7", pid=_dead_pid())
    with pytest.raises(CheckpointError, match="another host is never taken over: if that run has ended, delete"):
        SaveDirLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["host"] == "other-node-7"


def test_ckpt_lock_unreadable_file_refuses(tmp_path):
    (tmp_path / LOCK_FILENAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as a lock"):
        SaveDirLock(tmp_path).acquire()


def test_ckpt_lock_release_keeps_a_lock_someone_else_took_over(tmp_path):
    lock = SaveDirLock(tmp_path)
    lock.acquire()
    _write_owner(tmp_path, token="someone-else")
    lock.release()
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["token"] == "someone-else"
