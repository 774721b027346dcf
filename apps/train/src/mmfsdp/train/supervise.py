"""Process supervision: nothing hangs, nothing is orphaned, two runs never share a save directory.

The pieces and where they run:

- `guard_rank()` — in every rank started by torch's elastic agent (ours in
  `cli._launch`, or an external `torchrun`), first thing in `cli.main`. It sets
  `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills the rank when the thread
  that forked it exits. The agent forks its workers from its main thread
  (`torch.distributed.run.main` -> `LocalElasticAgent._start_workers` ->
  `subprocess.Popen`, no helper thread), so that thread lives exactly as long
  as the agent. A watchdog thread also polls `os.getppid()` once a second and
  exits when it changes: the portable fallback, and the cover for a parent
  that died before `prctl` ran (checked at once against `MMFSDP_LAUNCHER_PID`,
  which `cli._launch` exports). The agent starts ranks in their own session,
  so without this a SIGKILLed launcher leaves them training.
- `watch_launcher_parent()` — in the launcher (the `cli.py` process that is not
  a rank). `uv run` runs python as its child; if uv is SIGKILLed, the launcher
  would go on alone. Rule: the launcher watches its *direct* parent only when
  that parent is `uv` (its `/proc/<ppid>/comm`), or when `MMFSDP_WATCH_PARENT=1`.
  When that parent goes, the launcher sends itself SIGTERM, which the elastic
  agent turns into an orderly shutdown of its ranks. A reparented grandparent
  changes nothing: `nohup uv run apps/train ... &` keeps running after the
  shell exits, because uv (the direct parent) is still alive. No parent-death
  signal is used here: uv spawns from a tokio worker thread, which may exit
  while uv lives.
- `Heartbeat` — one daemon thread per rank. The trainer reports progress with
  `beat(phase)` and announces slow phases with `pause(phase)`, all through one
  `LoopHeartbeat` (the phase names of the training loop in one place). While armed, a
  rank that sees no beat for `parallel.heartbeat_timeout_s` writes one line on
  stderr naming its phase and the innermost `torch.distributed` frame of the
  main thread's stack (the collective it waits in), writes the full stack to
  `<output_dir>/hang_rank<r>.txt`, and exits with `HANG_EXIT_CODE`; the elastic
  agent then ends the other ranks. The watch is *not* armed during start-up
  (dataset, model build, loading), the first step, a save or the final
  evaluation: those have no bounded duration, and there the collective timeout
  (`parallel.collective_timeout_s`) is the guard. It is armed by the beat after
  each completed step (and after each save); micro-batch beats refresh it.
  When the hung rank exits, sibling ranks of its launcher that are stopped
  (SIGSTOP, state T) are SIGKILLed by a helper it forks, a second after its own exit
  (so the agent reads the hang's exit code first, also on a loaded machine): they cannot act on the
  agent's SIGTERM, and the agent would wait 30 s for them before its own SIGKILL.
- `take_save_lock()` — the `mmfsdp.ckpt.SaveDirLock` on `training.save`, taken
  by the launcher (or global rank 0 under an external torchrun), released at
  exit; `MMFSDP_SAVE_LOCKED=1` tells ranks their launcher holds it.
- `report_once()` — prints a clean error on the first rank that fails only,
  decided through the process group's store, so an error every rank hits is
  printed once.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Iterator

__all__ = [
    "LAUNCHER_PID_ENV",
    "SAVE_LOCKED_ENV",
    "HANG_EXIT_CODE",
    "guard_rank",
    "watch_launcher_parent",
    "Heartbeat",
    "start_heartbeat",
    "beat",
    "pause",
    "take_save_lock",
    "report_once",
    "set_process_name",
]

LAUNCHER_PID_ENV = "MMFSDP_LAUNCHER_PID"
SAVE_LOCKED_ENV = "MMFSDP_SAVE_LOCKED"
WATCH_PARENT_ENV = "MMFSDP_WATCH_PARENT"
HANG_EXIT_CODE = 124
_AGENT_POLL_GRACE_S = 1.0
"""How long after a hung rank's exit its helper waits before it kills stopped siblings (`_exit_after_hang`)."""
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_POLL_S = 1.0


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, on_death, name: str) -> threading.Thread:
    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        on_death()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def _parent_gone() -> None:
    print(f"[pid {os.getpid()}] the launcher is gone; this rank exits", file=sys.stderr, flush=True)
    os._exit(1)


def set_process_name(name: str) -> None:
    """The kernel's name of this process (`/proc/<pid>/comm`, what `ps -o comm` and `top` show; 15 bytes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def guard_rank() -> None:
    """In a rank started by torch's elastic agent: exit when the agent dies (see the module docstring); the
    process is named `mmfsdp-rank<RANK>` (a rank forked by the app's launcher shares its command line)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not started by an elastic agent: the parent is whatever the user chose
    set_process_name(f"mmfsdp-rank{os.environ.get('RANK', '')}")
    _set_parent_death_signal(signal.SIGKILL)
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    parent = int(expected) if expected.isdigit() else os.getppid()
    if os.getppid() != parent:
        _parent_gone()  # the launcher died before prctl ran
    _watch_parent(parent, _parent_gone, "mmfsdp-parent-watch")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def watch_launcher_parent() -> bool:
    """In the launcher: end the run when its direct parent `uv` (or any parent with MMFSDP_WATCH_PARENT=1) dies.

    Returns whether a watch was started.
    """
    parent = os.getppid()
    if os.environ.get(WATCH_PARENT_ENV) != "1" and _comm(parent) != "uv":
        return False

    def stop() -> None:
        print(f"the parent process (PID {parent}) is gone; stopping the run", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # the elastic agent shuts its ranks down on SIGTERM
        time.sleep(60)
        os._exit(1)

    _watch_parent(parent, stop, "mmfsdp-launcher-parent-watch")
    return True


def _innermost(stack: traceback.StackSummary, part: str) -> traceback.FrameSummary | None:
    for frame in reversed(stack):
        if part in frame.filename.replace(os.sep, "/"):
            return frame
    return None


def _where(frame: traceback.FrameSummary | None) -> str:
    return f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})" if frame else "?"


class Heartbeat:
    """A daemon thread that ends a rank which makes no progress for `timeout_s` while armed.

    `beat(phase, arm=...)` records progress (and arms the watch with `arm=True`);
    `pause(phase)` disarms it for a phase of unbounded length. `on_hang` is
    called after the report; it defaults to `os._exit(HANG_EXIT_CODE)`.
    """

    def __init__(self, timeout_s: float, *, rank: int, output_dir: str | os.PathLike,
                 thread: threading.Thread | None = None, on_hang=None):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.output_dir = Path(output_dir)
        self.watched = thread or threading.main_thread()
        self.on_hang = on_hang or _exit_after_hang
        self.phase = "start-up"
        self.armed = False
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._loop, name=f"mmfsdp-heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, phase: str, *, arm: bool = False) -> None:
        self.phase = phase
        self.last = time.monotonic()
        if arm:
            self.armed = True

    def pause(self, phase: str) -> None:
        self.phase = phase
        self.armed = False
        self.last = time.monotonic()

    def _loop(self) -> None:
        interval = min(max(self.timeout_s / 10, 0.05), 5.0)
        while not self._stop.wait(interval):
            idle = time.monotonic() - self.last
            if self.armed and idle > self.timeout_s:
                self.report(idle)
                self.on_hang()
                return

    def report(self, idle: float) -> str:
        """Write the one-line report on stderr and the full stack to `hang_rank<r>.txt`; return the line."""
        frame = sys._current_frames().get(self.watched.ident)
        stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
        waiting = _innermost(stack, "torch/distributed/") or (stack[-1] if stack else None)
        caller = _innermost(stack, "/mmfsdp/")
        path = self.output_dir / f"hang_rank{self.rank}.txt"
        line = (
            f"[rank {self.rank}] no progress for {idle:.0f} s (parallel.heartbeat_timeout_s={self.timeout_s:g}) "
            f"in {self.phase}; waiting in {_where(waiting)}, called from {_where(caller)}; "
            f"stack in {path}; exiting so the launcher ends the other ranks"
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(line + "\n\n" + "".join(stack.format()))
        except OSError as err:
            line += f" (could not write {path}: {err})"
        print(line, file=sys.stderr, flush=True)
        return line


def _stopped_siblings() -> list[int]:
    """PIDs of the other ranks of this launcher that are stopped (state T/t in `/proc/<pid>/stat`): children of
    the same parent named `mmfsdp-rank<r>` by `guard_rank` (a forked rank's `/proc/<pid>/environ` is its
    parent's, so the name is what tells a rank)."""
    parent = os.getppid()
    found = []
    for entry in Path("/proc").iterdir() if "TORCHELASTIC_RUN_ID" in os.environ else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] in ("T", "t") \
                    and (entry / "comm").read_text().startswith("mmfsdp-rank"):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _kill_stopped(pids: list[int]) -> None:
    rank = os.environ.get("RANK", "?")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            print(f"[rank {rank}] killed stopped rank process {pid}", file=sys.stderr, flush=True)
        except OSError:
            pass


def _exit_after_hang() -> None:
    # The elastic agent stops the other ranks with SIGTERM and waits 30 s before SIGKILL; a stopped rank
    # cannot act on SIGTERM, so it would hold the job for those 30 s. The job ends anyway: kill it, but only
    # once this rank has exited, so that the agent sees this rank's exit code (the hang) before the killed
    # rank's: a forked helper (not a rank; fork clears the parent-death signal) waits for this process to end.
    stopped = _stopped_siblings()
    if stopped:
        try:
            helper = os.fork()
        except OSError:
            helper = None
            _kill_stopped(stopped)
        if helper == 0:
            parent, deadline = os.getppid(), time.monotonic() + 5.0
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.005)
            # the agent polls its ranks every 0.1 s: on a loaded machine it may not have run since this rank
            # exited, and a poll that finds both ended may report the killed one (-9) instead of the hang
            time.sleep(_AGENT_POLL_GRACE_S)
            _kill_stopped(stopped)
            os._exit(0)
    os._exit(HANG_EXIT_CODE)


_heartbeat: Heartbeat | None = None


def start_heartbeat(timeout_s: float, *, rank: int, output_dir: str | os.PathLike) -> Heartbeat | None:
    """Start this process's heartbeat (none when `timeout_s` is 0); `beat` and `pause` then report to it."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None
    if timeout_s > 0:
        _heartbeat = Heartbeat(timeout_s, rank=rank, output_dir=output_dir).start()
    return _heartbeat


def beat(phase: str, *, arm: bool = False) -> None:
    """Progress in `phase`; `arm=True` (after a completed step or save) starts the watch. No-op without a heartbeat."""
    if _heartbeat is not None:
        _heartbeat.beat(phase, arm=arm)


def pause(phase: str) -> None:
    """Enter a phase of unbounded length (a save, the final evaluation): the watch waits for the next armed beat."""
    if _heartbeat is not None:
        _heartbeat.pause(phase)


class LoopHeartbeat:
    """The training loop's view of the heartbeat: the one place that names its phases. Components that run
    phases of unbounded length (validation, saving) take it and wrap them in `paused`."""

    def micro_batch(self, step: int, index: int, count: int) -> None:
        """Progress inside optimizer step `step`: micro-batch `index` (from 1) of `count`."""
        beat(f"step {step} micro-batch {index}/{count}")

    def step_done(self, step: int) -> None:
        """Step `step` is complete: arm the watch for the next one."""
        beat(f"step {step + 1}", arm=True)

    @contextlib.contextmanager
    def paused(self, phase: str, step: int) -> Iterator[None]:
        """An unbounded phase after step `step` (the watch waits); re-armed for the next step when it ends."""
        pause(phase)
        yield
        self.step_done(step)

    def pause(self, phase: str) -> None:
        """An unbounded phase the loop does not return from (the final evaluation)."""
        pause(phase)


def take_save_lock(save_dir: str | os.PathLike, *, announce=print):
    """Take `<save_dir>/.mmfsdp.lock` for this process (released at exit); raises `CheckpointError` when held."""
    from mmfsdp.ckpt import SaveDirLock

    lock = SaveDirLock(save_dir)
    notice = lock.acquire()
    atexit.register(lock.release)
    if notice:
        announce(notice)
    return lock


def report_once(message: str, *, rank: int, wait_s: float = 5.0) -> bool:
    """Print `[rank r] message` on stderr if no other rank reported first; returns whether it printed.

    The first rank to add to a counter in the process group's store prints. When the store
    cannot be reached within `wait_s` (its host is gone), the rank prints anyway.
    """
    first = [True]

    def claim() -> None:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        first[0] = store.add("mmfsdp/errors_reported", 1) == 1

    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        thread = threading.Thread(target=lambda: _quietly(claim), daemon=True)
        thread.start()
        thread.join(wait_s)
    if first[0]:
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    return first[0]


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # an unreachable store: the caller prints anyway
        pass


def lock_save_dir_for_job(save_dir: str | os.PathLike | None) -> None:
    """In every rank after `init_process_group`: unless the launcher holds the lock, global rank 0 takes it.

    Every rank learns rank 0's outcome (one broadcast) and raises the same `CheckpointError`
    when the directory is in use, so no rank of a multi-node job waits in a collective for a
    rank 0 that stopped.
    """
    if not save_dir or os.environ.get(SAVE_LOCKED_ENV) == "1":
        return
    import torch.distributed as dist

    from mmfsdp.ckpt import CheckpointError

    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            take_save_lock(save_dir)
        except CheckpointError as err:
            outcome[0] = str(err)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise CheckpointError(outcome[0])
