"""Run a script under tools/ as `python SCRIPT ARGS` runs it, without starting an interpreter for it.

`run_tool(script, args)` forks the script's process from the forkserver that `run_distributed`'s ranks fork from
(`mmfsdp.parallel.testing.forkserver_context`: it has imported torch, transformers, the families, data and ckpt
once per test process, conftest.py), and runs the file there as `__main__` (`runpy.run_path`) with `sys.argv`,
`sys.path[0]` (the script's directory), the working directory and the environment a fresh `python SCRIPT` would
have. The process is the script's own: its exit status (`SystemExit`, or 1 for an uncaught exception with the
traceback on stderr), its stdout and stderr (at the descriptor level, so its own subprocesses' output too), its
atexit handlers; what it spawns (ranks through `run_distributed`, subprocesses) it spawns as before. What this
saves is the interpreter start and the imports: about 4-8 CPU-seconds per run on the 2-core machine.

`start_script(script, args)` starts one the same way and returns at once with a `subprocess.Popen`-like handle
(`pid`, `poll`, `wait`, `returncode`): the process leads a session of its own, as `Popen(start_new_session=True)`
makes it, so a test can SIGKILL it and everything below it (`apprun.kill_tree`). `tests/apprun.py` runs the app's
command lines (`python apps/train CONFIG ...`, an example's `run.py`) through these, the launcher then forking its
ranks as it does on a CPU-only host.

Imported by the tests as `toolrun` (the `tests` directory is on pytest's `pythonpath`, which the forked process
inherits, so it can unpickle `_run_script`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_script(script: str, args: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str,
                new_session: bool = False) -> None:
    """The forked process: descriptors 1 and 2 to the files (`os.devnull` discards), then the script as
    `__main__`; `new_session`: first a session of its own."""
    import atexit
    import runpy

    from mmfsdp.parallel.device import freeze_startup_heap
    from mmfsdp.parallel.testing import fork_ranks_from_here

    if new_session:
        os.setsid()
    fork_ranks_from_here()  # the script's `run_distributed` ranks fork from it: its imports are done
    freeze_startup_heap()  # and no full garbage collection walks them (mmfsdp.parallel.device)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | (0 if path == os.devnull else os.O_CREAT | os.O_TRUNC))
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its processes with os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()


def _process(script: str | Path, args: list[str], env: dict[str, str] | None, cwd: Path, stdout: str, stderr: str,
             new_session: bool = False):
    from mmfsdp.parallel.testing import forkserver_context

    path = str(Path(cwd, script).resolve())
    process = forkserver_context().Process(
        target=_run_script,
        args=(path, list(args), str(cwd), dict(os.environ if env is None else env), stdout, stderr, new_session),
        daemon=False,  # the script may start processes of its own
    )
    process.start()
    return process


def run_tool(script: str | Path, args: list[str], *, timeout: float, env: dict[str, str] | None = None,
             cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`script` (a path, relative to `cwd` or absolute) with `args`, as a `subprocess.run(..., capture_output=True,
    text=True)` would give it; `env` defaults to this process's environment. A run past `timeout` is killed and
    raises `subprocess.TimeoutExpired`, as `subprocess.run` does."""
    command = [sys.executable, str(script), *args]
    with tempfile.TemporaryDirectory(prefix="toolrun_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        process = _process(script, args, env, cwd, str(out), str(err))
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_bytes(), err.read_bytes())
        return subprocess.CompletedProcess(command, process.exitcode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


class Started:
    """What `start_script` returns: the `subprocess.Popen` calls the tests use, on a forked process."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self._process), timeout)
        return self._process.exitcode


def start_script(script: str | Path, args: list[str], *, env: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> Started:
    """`script` with `args` started in a session of its own, its output discarded, as
    `subprocess.Popen([python, script, *args], start_new_session=True, stdout=DEVNULL, stderr=DEVNULL)` would."""
    return Started(_process(script, args, env, cwd, os.devnull, os.devnull, new_session=True))
