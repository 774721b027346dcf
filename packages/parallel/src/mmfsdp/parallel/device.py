"""Device type, communication backend, process group and memory helpers.

`detect_device_type()` picks `cuda`, then `npu` (Ascend, through the optional
`torch_npu` package, imported only here and only when there is no CUDA), then
`cpu`; `MMFSDP_DEVICE` overrides it. Everything else takes that device type:
`backend_for` maps it to `nccl` / `hccl` / `gloo`, `init_process_group` joins
the torchrun job and binds the local device, and the memory helpers dispatch to
`torch.cuda` or `torch.npu` (the module `torch_npu` registers), falling back to
the process's peak RSS on the CPU. `use_deterministic(device_type)` switches to
deterministic kernels (and collectives on NPU) for bitwise-repeatable runs. `freeze_startup_heap()` keeps Python's
cyclic garbage collector off the objects a process starts with.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError, get_logger

__all__ = [
    "DEVICE_TYPES",
    "detect_device_type",
    "backend_for",
    "init_process_group",
    "device_for_local_rank",
    "device_count",
    "reset_peak_memory",
    "peak_memory_gb",
    "synchronize",
    "use_deterministic",
    "freeze_startup_heap",
    "enable_fault_stacks",
]

DEVICE_TYPES = ("cuda", "npu", "cpu")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_GIB = float(1 << 30)


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return npu is not None and npu.is_available() and npu.device_count() > 0


def detect_device_type() -> str:
    """`cuda` if CUDA devices exist, else `npu` if `torch_npu` is installed and sees devices, else `cpu`.

    The environment variable `MMFSDP_DEVICE` (cuda, npu or cpu) overrides the detection.
    """
    forced = os.environ.get("MMFSDP_DEVICE", "").strip().lower()
    if forced:
        if forced not in DEVICE_TYPES:
            raise ConfigError("MMFSDP_DEVICE", f"{forced!r} is not one of {', '.join(DEVICE_TYPES)}; unset it to auto-detect")
        if forced == "cuda" and not torch.cuda.is_available():
            raise ConfigError("MMFSDP_DEVICE", "'cuda' was requested but torch sees no CUDA device; unset it to auto-detect")
        if forced == "npu" and not _npu_available():
            raise ConfigError("MMFSDP_DEVICE", "'npu' needs the torch_npu package (pip install 'mmfsdp-parallel[npu]') and a visible NPU")
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: nccl (cuda), hccl (npu), gloo (cpu)."""
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"unknown device type {device_type!r}; expected one of {', '.join(DEVICE_TYPES)}") from None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device_for_local_rank(device_type: str) -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` / `npu:LOCAL_RANK`, or `cpu`."""
    backend_for(device_type)
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, _local_rank())


def device_count(device_type: str) -> int:
    """Accelerators of this type visible on this node (1 for cpu: one process per node by default)."""
    backend_for(device_type)
    if device_type == "cpu":
        return 1
    if device_type == "npu":
        importlib.import_module("torch_npu")
    return getattr(torch, device_type).device_count()


def init_process_group(device_type: str, *, timeout_s: float = 1800.0) -> torch.device:
    """Join the job torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...) and return the local device.

    `timeout_s` is how long a collective waits for the other ranks before it
    fails (config `parallel.collective_timeout_s`).
    Binds the local accelerator first so collectives and `DeviceMesh` use it.
    Without torchrun variables it starts a one-process group, so single-process
    runs go through the same code. A group that already exists is kept.
    """
    device = device_for_local_rank(device_type)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    if dist.is_initialized():
        return device
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    backend = backend_for(device_type)
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    get_logger(__name__).info("process group: %d ranks, backend %s, device %s", dist.get_world_size(), backend, device_type)
    return device


def _accelerator(device: torch.device):
    return None if device.type == "cpu" else getattr(torch, device.type)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window on an accelerator (the CPU's peak RSS cannot be reset)."""
    module = _accelerator(torch.device(device))
    if module is not None:
        module.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GiB: allocated tensors on cuda/npu since the last reset; the process's peak RSS on cpu."""
    device = torch.device(device)
    module = _accelerator(device)
    if module is not None:
        return module.max_memory_allocated(device) / _GIB
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _GIB if sys.platform == "darwin" else peak * 1024 / _GIB  # bytes on macOS, KiB on Linux


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    module = _accelerator(torch.device(device))
    if module is not None:
        module.synchronize(device)


DETERMINISTIC_ENV = {"cuda": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "npu": {"HCCL_DETERMINISTIC": "true"}}
"""What each device needs in the environment for deterministic runs (cuBLAS workspaces; HCCL's reductions)."""


def use_deterministic(device_type: str) -> None:
    """Deterministic algorithms only: an op without a deterministic kernel raises instead of running.

    Sets `DETERMINISTIC_ENV` (unless already set), which cuBLAS and HCCL read when they start: call it
    before the first kernel and before `init_process_group`. Then `torch.use_deterministic_algorithms(True)`
    and cuDNN's deterministic, non-benchmarking mode.
    """
    for name, value in DETERMINISTIC_ENV.get(device_type, {}).items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def enable_fault_stacks() -> None:
    """A process that dies on a signal (a segmentation fault in an extension, glibc's abort on a corrupted heap)
    prints every thread's Python stack to its stderr first (`faulthandler`, to the process's own fd 2: a launcher's
    log or a test's output keeps it): where a rank died, not only that it did. Nothing when there is no real
    stderr to print to."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


def freeze_startup_heap() -> None:
    """Move every object alive now to the interpreter's permanent generation (`gc.freeze`): the modules a rank
    starts with (torch, transformers, ours: millions of objects) and what it has built so far. Python's full
    collections then walk only what the process creates afterwards, instead of the whole import heap each time:
    on the test machine one full collection of a rank forked from a process that had imported torch and
    transformers took 0.33 s (it found ~250 garbage objects), at whatever moment an allocation tripped it (a
    checkpoint's planning, a step). Costs microseconds; it is what Python's docs advise before forking workers
    (their pages are then not copied by the collector either). Reference counting frees these objects as before;
    only a reference cycle among them that becomes garbage later stays allocated. Once per process (a later call in
    the same process, e.g. a second trainer's, would also freeze the first one's garbage): call it early."""
    global _FROZEN_PID
    if _FROZEN_PID != os.getpid():
        _FROZEN_PID = os.getpid()
        gc.freeze()


_FROZEN_PID: int | None = None
