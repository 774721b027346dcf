"""Spawn N gloo ranks on the CPU for tests and report a failure from any rank.

`run_distributed(fn, world_size, *args)` starts `world_size` fresh processes, each
of which joins a gloo process group and calls `fn(rank, world_size, *args)`.
The processes are forked from a multiprocessing forkserver that has imported
torch, FSDP2/DCP and `mmfsdp.parallel` once (per test process), plus whatever the
caller names with `preload_for_ranks` (the suite's conftest.py names transformers,
the model families, data and ckpt): a spawned rank would spend about 12 s of CPU
on those imports, the bulk of a small distributed test. The forkserver holds no threads, so forking it is safe;
each rank still starts its own process group, and gets the caller's current
environment variables.
It returns the per-rank return values (rank order). If any rank raises, the
others are terminated and an `AssertionError` carrying that rank's traceback is
raised in the caller, so a failing assertion on rank 1 never hangs rank 0.

`fn` is located by its source file and name rather than pickled by module
path, because pytest's importlib import mode gives test modules names that a
spawned child cannot import. `fn` must therefore be a module-level function;
`args` must be picklable. Return values travel as `torch.save` bytes (tensors
in a queue would be shared-memory handles that die with the child) and are read
back with `weights_only=True`: tensors, numbers, strings and containers of them.

`record_margin(diff, tol, what)` appends a parity check's measured difference and its bound to the JSON-lines file
that `MMFSDP_RECORD_MARGINS` names (nothing where it is unset), with the running test's id: every numeric comparison
of the suite goes through it (`assert_within(diff, tol, what)` here, `mmfsdp.model.testing.assert_close`, the end
to end tests' `apprun.close`), so that `tools/tolerance_margins.py` shows how close each test comes to its tolerance
on a machine. Spawned ranks inherit the variable and the test id, so a check made on a rank is recorded too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = [
    "fork_ranks_from_here",
    "rank_may_start_processes",
    "run_distributed", "free_port", "preload_for_ranks", "forkserver_context", "record_margin", "assert_within",
    "MARGINS_ENV",
]

MARGINS_ENV = "MMFSDP_RECORD_MARGINS"
"""A JSON-lines file each `record_margin` appends `{"test", "what", "diff", "tol"}` to; unset: nothing recorded."""


def record_margin(diff: float, tol: float, what: str = "") -> None:
    """Append the measured `diff` and its bound `tol` to the file `MMFSDP_RECORD_MARGINS` names, if any."""
    target = os.environ.get(MARGINS_ENV)
    if target:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(target, "a") as out:
            out.write(json.dumps({"test": test, "what": what, "diff": float(diff), "tol": float(tol)}) + "\n")


def assert_within(diff: float, tol: float, what: str = "") -> float:
    """Record `diff` against `tol` (`record_margin`), assert `diff <= tol` (the message names `what` and both
    numbers); return `diff`."""
    record_margin(diff, tol, what)
    assert diff <= tol, f"{what}: relative difference {diff:.3g} > {tol:.3g}"
    return diff


@contextlib.contextmanager
def rank_may_start_processes():
    """Within it, a rank of `run_distributed` (a daemonic process, so that it ends with the test) may start child
    processes, as a rank under torchrun may (`multiprocessing` forbids a daemonic process children): e.g. GRPO's
    reward workers, which end with their pipe."""
    config = mp.current_process()._config
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_function(path: str, name: str) -> Callable[..., Any]:
    module_name = f"_mmfsdp_dist_{abs(hash(path))}"
    if module_name in sys.modules:
        return getattr(sys.modules[module_name], name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "mmfsdp.parallel",
]
"""Modules the forkserver imports once; a name that fails to import is skipped (multiprocessing's rule)."""


def preload_for_ranks(*modules: str) -> None:
    """Have the forkserver the ranks fork from import `modules` too; call before this process's first
    `run_distributed` (the forkserver starts then and keeps its imports)."""
    _PRELOAD.extend(module for module in modules if module not in _PRELOAD)


_FORKED_WITH_IMPORTS = False
"""Set in a process forked from a forkserver that had imported `_PRELOAD` (`fork_ranks_from_here`)."""


def fork_ranks_from_here() -> None:
    """Mark this process as forked from a preloaded forkserver (`tests/toolrun.py` calls it in the script processes
    it forks): its ranks are then forked from it directly while it is single-threaded and has no accelerator
    context, instead of from a forkserver of its own, which would start a fresh interpreter and import torch again
    (2.5-6 s of CPU per script). Its children get the same imports either way."""
    global _FORKED_WITH_IMPORTS
    _FORKED_WITH_IMPORTS = True


def _may_fork_directly() -> bool:
    import threading

    if not _FORKED_WITH_IMPORTS or threading.active_count() != 1 or any(m not in sys.modules for m in _PRELOAD):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()  # asks no driver (is_available may initialise one)


def forkserver_context() -> mp.context.BaseContext:
    """The multiprocessing context whose forkserver has imported `_PRELOAD` (one per process, started on first use);
    in a process marked by `fork_ranks_from_here`, while it may, the fork context (this process's imports)."""
    if _may_fork_directly():
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process first starts its forkserver
    return ctx


def _child(rank: int, world_size: int, port: int, path: str, name: str, args: tuple, env: dict, results) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch
        import torch.distributed as dist

        from mmfsdp.parallel.device import enable_fault_stacks, freeze_startup_heap

        enable_fault_stacks()  # a rank that dies on a signal prints its stacks into the test's output

        freeze_startup_heap()  # the forkserver's imports: no full collection walks them in every rank
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn = _load_function(path, name)
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))


def _dead_or_late(procs, values: dict, results, deadline: float, timeout: float) -> tuple[int, str] | None:
    """While no rank reported: a rank that exited without reporting (killed, or dead before `_child` ran: e.g. a
    script without a `__main__` guard), or the timeout passed; None to go on waiting. What a rank put before it
    exited is read first (`values` filled in)."""
    for rank, proc in enumerate(procs):
        if rank in values or proc.exitcode is None:
            continue
        try:
            while True:  # its result may still be on its way
                got, status, payload = results.get(timeout=1.0)
                if status == "error":
                    return got, payload
                values[got] = payload
        except queue.Empty:
            pass
        if rank not in values:
            return rank, f"exited with code {proc.exitcode} before reporting (its output is above)"
    if time.monotonic() >= deadline:
        return -1, f"timed out after {timeout:.0f}s waiting for ranks {sorted(set(range(len(procs))) - set(values))}"
    return None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's value."""
    ctx = forkserver_context()
    results = ctx.Queue()
    port = free_port()
    path = fn.__code__.co_filename
    child_env = {**os.environ, **(env or {})}  # the forkserver's own environment is that of its start
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, path, fn.__name__, args, child_env, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, status, payload = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                failure = _dead_or_late(procs, values, results, deadline, timeout)
                continue
            if status == "error":
                failure = (rank, payload)
            else:
                values[rank] = payload
    finally:
        if failure is not None:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if failure is not None:
        rank, text = failure
        where = f"rank {rank}" if rank >= 0 else "run_distributed"
        raise AssertionError(f"{where} failed:\n{text}")
    import torch

    return [torch.load(io.BytesIO(values[rank]), weights_only=True) for rank in range(world_size)]
