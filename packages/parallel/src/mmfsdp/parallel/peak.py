"""Peak FLOP/s of one device, the denominator of MFU.

An accelerator's peak comes from `PEAK_TFLOPS`, matched against its name (`torch.cuda.get_device_name()`,
torch_npu's `torch.npu.get_device_name()`) in table order, so that a more specific name comes first
(`H100 PCIe` before `H100`). The numbers are the vendors' dense (no sparsity) tensor-core figures for bf16
(fp16 is the same), and plain fp32 without TF32 (torch's default matmul precision, "highest"). A device the table
does not know, or a peak the user knows better, is given by `tools.peak_tflops`.

A CPU has no table entry (nor has an accelerator the table does not match): its peak is measured once at start by
timing a square GEMM in the compute dtype (`measure_gemm_tflops`), on every rank at the same time so that ranks
sharing cores share them as during training. That is the GEMM rate this machine reaches, not a datasheet number:
the MFU of a CPU run says how far the step is from doing nothing but large matmuls. The measured rate is kept in
a file of this machine (`peak_cache_path`, keyed by `measured_peak_key`: processor, dtype, threads, ranks on the
machine, torch version), so later runs of the same shape read it instead of timing again, and their MFU numbers
share one denominator; delete the file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from mmfsdp.parallel.device import synchronize

__all__ = ["PEAK_TFLOPS", "cached_peak", "device_name", "measure_gemm_tflops", "measured_peak_key", "peak_cache_path",
           "processor_name", "store_peak", "table_peak_tflops"]

PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    # (name pattern, bf16/fp16 dense tensor core, fp32 without TF32), TFLOP/s per device
    (r"H100.*PCIe", 756.0, 51.0),
    (r"H100.*NVL", 835.0, 60.0),
    (r"H100|H800", 989.0, 67.0),
    (r"H200", 989.0, 67.0),
    (r"A100|A800", 312.0, 19.5),
    (r"B200", 2250.0, 75.0),
    (r"910B1|910B2C|910B2", 376.0, 94.0),
    (r"910B3|910B", 313.0, 75.0),
    (r"950", 500.0, 125.0),
)
"""Ascend: 910B1/910B2 376 and other 910B 313 TFLOP/s fp16; the 950's bf16 is taken as half its announced
1 PFLOP/s FP8. The Ascend fp32 figures are estimates (a quarter of fp16); set `tools.peak_tflops` where a
device's own figure is known better."""


def device_name(device: torch.device) -> str:
    """The accelerator's name as its runtime reports it; "cpu" for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    return "cpu"


def table_peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    """The table's peak for a device called `name` computing in `dtype`; None when no entry matches."""
    for pattern, half, single in PEAK_TFLOPS:
        if re.search(pattern, name):
            return single if dtype == torch.float32 else half
    return None


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, *, size: int = 512, seconds: float = 0.05) -> float:
    """TFLOP/s of `size`² × `size`² matmuls in `dtype` on `device`, run back to back for about `seconds` after one
    warm-up. 0.05 s is about ten 512² fp32 GEMMs on one core, paid by each rank of a CPU run once at start; over 8
    runs each on a loaded 2-core machine, the median rate was within 2 % of 0.2 s runs' and the spread the same
    (the load, not the length, moves it)."""
    # a generator of its own: the run's RNG streams (restored on resume) are left as they are
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.rand(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.mm(a, b)
    done = 0
    started = time.perf_counter()
    while True:
        torch.mm(a, b)
        done += 1
        synchronize(device)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2 * size**3 * done / elapsed / 1e12


def peak_cache_path() -> Path:
    """The file of measured peaks: `$XDG_CACHE_HOME/mmfsdp/peak_tflops.json` (default `~/.cache/...`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmfsdp" / "peak_tflops.json"


def processor_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else `platform.processor()` or the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_peak_key(device: torch.device, dtype: torch.dtype, local_ranks: int) -> str:
    """What a measured peak depends on: the device (and the processor for a CPU), the dtype, this process's threads,
    how many ranks share the machine while they time (`local_ranks`) and torch's version."""
    name = device_name(device)
    where = f"{name} ({processor_name()})" if device.type == "cpu" else name
    return (f"{where} | {str(dtype).removeprefix('torch.')} | {torch.get_num_threads()} threads | "
            f"{local_ranks} ranks | torch {torch.__version__}")


def cached_peak(key: str) -> float | None:
    """The peak stored under `key`, None when there is none (or the file cannot be read)."""
    try:
        value = json.loads(peak_cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def store_peak(key: str, tflops: float) -> None:
    """Add `key: tflops` to the file (written whole to a temporary file, then renamed over it: a reader never
    sees half a file); a file that cannot be written is left as it is."""
    path = peak_cache_path()
    try:
        try:
            table = json.loads(path.read_text())
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[key] = tflops
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)
    except OSError:
        pass
