"""The launcher's log file: everything the app's launcher and its ranks print, also written to one file.

`start_console_log(output_dir)` runs in the app's own launcher (the `cli.py` process that is not a rank, also the
single process of a one-rank run), after the config passed its checks and before any rank starts:

1. it opens `<output_dir>/logs/train_<YYYYmmdd_HHMMSS>.log` (a `_<pid>` suffix if that name is taken);
2. it starts a helper process, `python -m mmfsdp.train.console`, named `mmfsdp-log`, that holds the
   launcher's original stdout and stderr and the read ends of two pipes;
3. it points its own file descriptors 1 and 2 at the pipes' write ends, which every rank inherits (forked or
   exec'd), and logs one line naming the file; that line is the file's first.

The helper copies each chunk it reads to the original stream (stdout stays stdout, stderr stays stderr) and
appends it to the file, until every writer has closed its end; the launcher waits for it at exit (up to 5 s), so
the last lines reach the console before the shell's prompt. It is a process, not a thread of the launcher, so
what a process prints just before `os._exit`, or a rank's last words after its launcher was SIGKILLed, still
reaches the file; it ignores SIGINT, so Ctrl-C in the terminal leaves it to drain the shutdown messages. A
console that goes away (a closed terminal) stops the copies to it, not the file.

Under an external `torchrun` there is no launcher of ours: the example scripts `tee` torchrun's output into
`logs/` themselves (docs/reliability.md, "One job, one voice, one log").
"""

from __future__ import annotations

import atexit
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_console_log"]

_CHUNK = 1 << 16
_DRAIN_S = 5.0


def _open_log(output_dir: str | os.PathLike) -> tuple[Path, int]:
    logs = Path(output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    for name in (f"train_{stamp}.log", f"train_{stamp}_{os.getpid()}.log"):
        try:
            return logs / name, os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            continue
    raise FileExistsError(f"{logs}/train_{stamp}_{os.getpid()}.log exists")


def start_console_log(output_dir: str | os.PathLike) -> Path:
    """Copy this process's stdout and stderr, and those of every process it starts from now on, to a new file
    under `<output_dir>/logs/`; returns its path (see the module docstring)."""
    path, log_fd = _open_log(output_dir)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        helper = subprocess.Popen(
            [sys.executable, "-m", "mmfsdp.train.console", str(log_fd), str(out_read), str(err_read)],
            stdin=subprocess.DEVNULL, pass_fds=(log_fd, out_read, err_read),
        )
    finally:
        for fd in (log_fd, out_read, err_read):
            os.close(fd)
    atexit.register(_drain, helper, os.getpid(), os.dup(1), os.dup(2))
    os.dup2(out_write, 1)
    os.dup2(err_write, 2)
    os.close(out_write)
    os.close(err_write)
    # The streams now write to pipes: keep whole lines flowing (forked ranks inherit these objects; exec'd ranks
    # read PYTHONUNBUFFERED).
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return path


def _drain(helper: subprocess.Popen, launcher: int, console_out: int, console_err: int) -> None:
    """At the launcher's normal exit: give back its ends of the pipes and let the helper copy what is left before
    the launcher's own parent (a shell, `uv`) takes over the console again."""
    if os.getpid() != launcher:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.dup2(console_out, 1)
    os.dup2(console_err, 2)
    try:
        helper.wait(timeout=_DRAIN_S)
    except subprocess.TimeoutExpired:  # a process that outlived the launcher still holds a pipe: do not wait for it
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy(log_fd: int, sources: dict[int, int]) -> None:
    """Copy each pipe of `sources` (pipe -> console fd) to its console fd and to `log_fd` until every pipe ends."""
    selector = selectors.DefaultSelector()
    for fd in sources:
        selector.register(fd, selectors.EVENT_READ)
    console_open = True
    while sources:
        for key, _ in selector.select():
            data = os.read(key.fd, _CHUNK)
            if not data:
                selector.unregister(key.fd)
                del sources[key.fd]
                continue
            if console_open:
                try:
                    _write_all(sources[key.fd], data)
                except OSError:  # the terminal or the reading end is gone: the file goes on
                    console_open = False
            try:
                _write_all(log_fd, data)
            except OSError:
                pass


def _main(argv: list[str]) -> None:
    from mmfsdp.train.supervise import set_process_name

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_name("mmfsdp-log")
    log_fd, out_read, err_read = (int(a) for a in argv)
    _copy(log_fd, {out_read: 1, err_read: 2})


if __name__ == "__main__":
    _main(sys.argv[1:])
