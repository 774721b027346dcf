"""Benchmark the chunked lm_head + cross-entropy against the plain `lm_head` + `cross_entropy`.

Both variants run forward + backward of `Σ_t w_t · CE(h_t Wᵀ, y_t)` (fp32 loss
math) for `--tokens` hidden states of size `--hidden` and a `--vocab`-row
weight, and produce the gradients of the hidden states and of the weight:

    plain    (cross_entropy(F.linear(h, W).float(), y, reduction="none") * w).sum()
    chunked  mmfsdp.model.chunked_linear_cross_entropy(h, W, None, y, w, chunk_size)

Memory: each variant runs one step in a fresh subprocess, so that the CPU's
peak resident set (which cannot be reset) is that variant's alone; glibc gets a
fixed mmap threshold there, so every large tensor is mapped and unmapped and
the resident set follows the live tensors. On cuda/npu the allocator's peak is
used. "Peak extra memory" is the working memory of the loss: the peak during
forward + backward minus what is held once it is done (inputs, weight and
their gradients, the same for both variants). The chunked variant allocates the
weight gradient already in its forward; `lm_head`'s backward follows its
forward immediately, so that changes no real step's peak. The peak over what
was held *before* the step (counting the weight gradient in both) is reported
too, as `peak_over_start_mb`.

Time: this process then runs the two variants alternately (no memory is
measured in it), `--repeats` rounds after a warm-up of each, and reports each variant's fastest round (the
estimate least disturbed by other load on a shared machine) and its median.

    uv run python tools/bench/chunk_loss.py                       # CPU, Magistral vocab, hidden 1024, 4096 tokens
    uv run python tools/bench/chunk_loss.py --device cuda --hidden 5120 --tokens 8192 --dtype bf16
    uv run python tools/bench/chunk_loss.py --smoke                 # the smallest run (CI): vocab 4096, 256 tokens

The last line printed is one JSON object with `peak_mem_ratio` and
`time_ratio` (chunked / plain, fastest rounds). Target: peak_mem_ratio <= 1/8,
time_ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import get_args

from _smoke import parse_args

from mmfsdp.parallel.config import DType

VARIANTS = ("plain", "chunked")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=131072, help="vocabulary size (Magistral: 131072)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (Magistral: 5120)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk of the chunked variant")
    parser.add_argument(
        "--dtype", choices=get_args(DType), default="fp32", help="dtype of the hidden states and weight"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each runs both variants) after a warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--mode", choices=("memory-plain", "memory-chunked", "time"), help=argparse.SUPPRESS)
    return parser


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _Setup:
    """Inputs on the device and one forward + backward step of either variant."""

    def __init__(self, args: argparse.Namespace):
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        self.torch = torch
        self.chunk_size = args.chunk_size
        self.device = torch.device(args.device)
        if self.device.type == "npu":
            import torch_npu  # noqa: F401  (registers the device)
        self.accel = None if self.device.type == "cpu" else getattr(torch, self.device.type)
        from mmfsdp.parallel.dtypes import DTYPES

        dtype = DTYPES[args.dtype]
        generator = torch.Generator().manual_seed(0)
        self.weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(self.device, dtype).requires_grad_()
        self.hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(self.device, dtype).requires_grad_()
        self.targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(self.device)
        self.loss_weights = torch.full((args.tokens,), 1.0 / args.tokens, device=self.device)

    def step(self, variant: str) -> float:
        import torch.nn.functional as F

        from mmfsdp.model import chunked_linear_cross_entropy

        self.weight.grad = self.hidden.grad = None
        if variant == "plain":
            per_token = F.cross_entropy(F.linear(self.hidden, self.weight).float(), self.targets, reduction="none")
            loss = (per_token * self.loss_weights).sum()
        else:
            loss = chunked_linear_cross_entropy(self.hidden, self.weight, None, self.targets, self.loss_weights, self.chunk_size)
        loss.backward()
        self.sync()
        return loss.item()

    def sync(self) -> None:
        if self.accel is not None:
            self.accel.synchronize()

    def held(self) -> int:
        self.sync()
        return _resident_bytes() if self.accel is None else self.accel.memory_allocated(self.device)

    def peak(self) -> int:
        return _peak_resident_bytes() if self.accel is None else self.accel.max_memory_allocated(self.device)


def _measure_memory(args: argparse.Namespace, variant: str) -> dict:
    setup = _Setup(args)
    if setup.accel is not None:
        setup.accel.reset_peak_memory_stats(setup.device)
    start = setup.held()
    loss = setup.step(variant)
    peak, end = setup.peak(), setup.held()
    grads = [setup.hidden.grad.float().norm().item(), setup.weight.grad.float().norm().item()]
    return {"loss": loss, "grad_norms": grads, "peak_extra_mb": (peak - end) / 2**20, "peak_over_start_mb": (peak - start) / 2**20}


def _measure_time(args: argparse.Namespace) -> dict:
    setup = _Setup(args)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for variant in VARIANTS:
        setup.step(variant)
    for _ in range(args.repeats):
        for variant in VARIANTS:
            started = time.perf_counter()
            setup.step(variant)
            times[variant].append(time.perf_counter() - started)
    return {variant: {"time_s": min(ts), "median_s": statistics.median(ts)} for variant, ts in times.items()}


def _subprocess(mode: str, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--mode", mode]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args(_parser(), vocab=4096, hidden=64, tokens=256, chunk_size=64, repeats=1)
    if args.mode is not None:
        result = _measure_time(args) if args.mode == "time" else _measure_memory(args, args.mode.removeprefix("memory-"))
        print(json.dumps(result))
        return
    # glibc would otherwise hand freed large blocks out again from its heap without returning them,
    # and the resident set would over-count; a fixed mmap threshold maps and unmaps every large tensor.
    memory = {variant: _subprocess(f"memory-{variant}", {"MALLOC_MMAP_THRESHOLD_": "131072"}) for variant in VARIANTS}
    timing = _measure_time(args)
    for variant in VARIANTS:
        m, t = memory[variant], timing[variant]
        print(
            f"{variant:8s} peak extra memory {m['peak_extra_mb']:9.1f} MiB (over the start {m['peak_over_start_mb']:9.1f} MiB)"
            f"   time {t['time_s']:7.3f} s (median {t['median_s']:7.3f} s)   loss {m['loss']:.6f}"
        )
    plain, chunked = memory["plain"], memory["chunked"]
    summary = {
        "peak_mem_ratio": chunked["peak_extra_mb"] / plain["peak_extra_mb"],
        "time_ratio": timing["chunked"]["time_s"] / timing["plain"]["time_s"],
        "median_time_ratio": timing["chunked"]["median_s"] / timing["plain"]["median_s"],
        "peak_over_start_ratio": chunked["peak_over_start_mb"] / plain["peak_over_start_mb"],
        "loss_rel_diff": abs(chunked["loss"] - plain["loss"]) / abs(plain["loss"]),
        "grad_norm_rel_diff": max(abs(c - p) / p for c, p in zip(chunked["grad_norms"], plain["grad_norms"])),
        **{v: {**{k: memory[v][k] for k in ("peak_extra_mb", "peak_over_start_mb")}, **timing[v]} for v in VARIANTS},
        "config": {k: getattr(args, k) for k in ("vocab", "hidden", "tokens", "chunk_size", "dtype", "device", "repeats")},
    }
    print(
        f"ratios (chunked / plain): peak extra memory {summary['peak_mem_ratio']:.3f}, "
        f"time {summary['time_ratio']:.3f} (medians {summary['median_time_ratio']:.3f})"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
