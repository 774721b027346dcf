"""The save-directory lock: one run writes one `training.save` directory at a time.

`SaveDirLock.acquire()` creates `<save>/.mmfsdp.lock`, a small JSON file
naming the owner (host, PID, the process's start time, the command). The
file is written to a private temporary name first and then hard-linked to
the lock name, so the lock appears atomically and always with its content;
`os.link` fails when the name exists, which is the test-and-set.

When the lock exists:

- owned by a live process on this host -> `CheckpointError` naming the owner;
- owned by a dead process on this host, or by a process whose PID has been
  reused (its start time in `/proc/<pid>/stat` differs from the recorded one)
  -> the lock is stale: it is renamed away (only one taker can win the rename),
  a one-line notice is returned and the lock is taken;
- owned by another host -> `CheckpointError`: liveness cannot be checked from
  here, so the lock is never taken over automatically; the message says how
  to remove it by hand;
- unreadable (not JSON) -> `CheckpointError` too: the owner is unknown.

`release()` removes the file only while it still carries this holder's token,
so a run never deletes a lock some other run took over. A SIGKILLed run leaves
its lock behind; the next run finds it stale and takes it over.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from mmfsdp.ckpt.errors import CheckpointError

__all__ = ["LOCK_FILENAME", "SaveDirLock", "process_start_ticks", "pid_alive"]

LOCK_FILENAME = ".mmfsdp.lock"


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (`/proc/<pid>/stat` field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this host (zombies count as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _describe(owner: dict) -> str:
    since = owner.get("since") or "an unknown time"
    return f"host {owner.get('host', '?')}, PID {owner.get('pid', '?')}, since {since}"


class SaveDirLock:
    """An exclusive lock on one save directory; see the module docstring for the rules."""

    def __init__(self, save_dir: str | os.PathLike, *, command: list[str] | None = None):
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / LOCK_FILENAME
        self.command = list(sys.argv if command is None else command)
        self.token = uuid.uuid4().hex
        self.held = False

    def _record(self) -> dict:
        pid = os.getpid()
        return {
            "host": socket.gethostname(),
            "pid": pid,
            "start_ticks": process_start_ticks(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(self.command),
            "token": self.token,
        }

    def _try_create(self) -> bool:
        tmp = self.save_dir / f"{LOCK_FILENAME}.{self.token}.tmp"
        tmp.write_text(json.dumps(self._record(), indent=1) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _read_owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise CheckpointError(
                f"{self.path} exists but cannot be read as a lock ({err}); another run may own {self.save_dir}: "
                f"if none does, delete {self.path} and start again"
            ) from None

    def _stale_reason(self, owner: dict) -> str | None:
        """Why `owner` is stale (same host only), or None while it is alive."""
        pid = owner.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return "it names no valid PID"
        if not pid_alive(pid):
            return f"PID {pid} is not running"
        recorded, current = owner.get("start_ticks"), process_start_ticks(pid)
        if recorded is not None and current is not None and recorded != current:
            return f"PID {pid} now belongs to a different process"
        return None

    def acquire(self) -> str | None:
        """Take the lock. Returns a one-line notice when a stale lock was taken over, else None.

        Raises `CheckpointError` (one line naming the owner and what to do) while another run holds it.
        """
        self.save_dir.mkdir(parents=True, exist_ok=True)
        notice = None
        for _ in range(5):
            if self._try_create():
                self.held = True
                return notice
            owner = self._read_owner()
            if owner is None:
                continue  # released between our link and our read: try again
            if owner.get("host") != socket.gethostname():
                raise CheckpointError(
                    f"{self.save_dir} is in use by another run ({_describe(owner)}; command: {owner.get('command', '?')}); "
                    f"a lock from another host is never taken over: if that run has ended, delete {self.path} "
                    "by hand, or choose another training.save"
                )
            reason = self._stale_reason(owner)
            if reason is None:
                raise CheckpointError(
                    f"{self.save_dir} is in use by another run ({_describe(owner)}; command: {owner.get('command', '?')}); "
                    "wait for it to end, stop it, or choose another training.save"
                )
            aside = self.path.with_name(f"{LOCK_FILENAME}.stale.{self.token}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue  # another run moved it first
            try:
                moved = json.loads(aside.read_text())
            except (OSError, ValueError):
                moved = None
            if moved is None or moved.get("token") != owner.get("token"):
                # Another run took the stale lock over between our read and our rename: give it back.
                try:
                    os.link(aside, self.path)
                finally:
                    aside.unlink(missing_ok=True)
                continue
            aside.unlink(missing_ok=True)
            notice = f"took over a stale lock on {self.save_dir} ({_describe(owner)}): {reason}"
        raise CheckpointError(f"could not take the lock {self.path}: it keeps changing; is another run starting?")

    def release(self) -> None:
        """Remove the lock if this holder still owns it; safe to call more than once."""
        if not self.held:
            return
        self.held = False
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if owner.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "SaveDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
