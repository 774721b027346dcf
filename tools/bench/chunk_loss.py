"""Benchmark the chunked lm_head + cross-entropy against the plain `lm_head` + `cross_entropy`.

Both variants run forward + backward of `Σ_t w_t · CE(h_t Wᵀ, y_t)` (fp32 loss
math) for `--tokens` hidden states of size `--hidden` and a `--vocab`-row
weight, and produce the gradients of the hidden states and of the weight:

    plain    logits = F.linear(h, W); (cross_entropy(logits.float(), y, reduction="none") * w).sum()
    chunked  mmfsdp.model.chunked_linear_cross_entropy(h, W, None, y, w, chunk_size)

Each variant runs in a fresh subprocess, so that the CPU's peak resident set
(which cannot be reset) belongs to that variant alone; on cuda/npu the
allocator's peak is used. "Peak extra memory" is the working memory of the
loss: the peak during forward + backward minus what is held once it is done
(inputs, weight and their gradients, identical for both variants). The chunked
variant allocates the weight gradient already in the forward; since `lm_head`'s
backward follows its forward immediately, that changes no real step's peak.
The peak over the memory held *before* the step (which counts the weight
gradient in both) is reported too, as `peak_over_start_mb`. Time is the median
of `--repeats` iterations after one warm-up.

    uv run python tools/bench/chunk_loss.py                       # CPU, Magistral vocab, hidden 1024, 4096 tokens
    uv run python tools/bench/chunk_loss.py --device cuda --hidden 5120 --tokens 8192 --dtype bf16

The last line printed is one JSON object with `peak_mem_ratio` and
`time_ratio` (chunked / plain). Target: peak_mem_ratio <= 1/8, time_ratio <= 1.15.
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

DTYPES = ("fp32", "bf16", "fp16")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=131072, help="vocabulary size (Magistral: 131072)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (Magistral: 5120)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk of the chunked variant")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the hidden states and weight")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--repeats", type=int, default=3, help="timed iterations after one warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--variant", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    return parser


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _run_variant(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from mmfsdp.model import chunked_linear_cross_entropy

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers the device)
    accel = None if device.type == "cpu" else getattr(torch, device.type)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(device, dtype).requires_grad_()
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(device, dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(device)
    loss_weights = torch.full((args.tokens,), 1.0 / args.tokens, device=device)

    def step() -> float:
        weight.grad = hidden.grad = None
        if args.variant == "plain":
            per_token = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
            loss = (per_token * loss_weights).sum()
        else:
            loss = chunked_linear_cross_entropy(hidden, weight, None, targets, loss_weights, args.chunk_size)
        loss.backward()
        return loss.item()

    def held() -> int:
        if accel is None:
            return _resident_bytes()
        accel.synchronize()
        return accel.memory_allocated(device)

    if accel is not None:
        accel.reset_peak_memory_stats(device)
    start_bytes = held()
    loss = step()
    times = []
    for _ in range(args.repeats):
        if accel is not None:
            accel.synchronize()
        start = time.perf_counter()
        loss = step()
        if accel is not None:
            accel.synchronize()
        times.append(time.perf_counter() - start)
    peak = accel.max_memory_allocated(device) if accel is not None else _peak_resident_bytes()
    end_bytes = held()
    return {
        "loss": loss,
        "peak_extra_mb": (peak - end_bytes) / 2**20,
        "peak_over_start_mb": (peak - start_bytes) / 2**20,
        "time_s": statistics.median(times),
        "grad_norms": [hidden.grad.float().norm().item(), weight.grad.float().norm().item()],
    }


def main() -> None:
    args = _parser().parse_args()
    if args.variant is not None:
        print(json.dumps(_run_variant(args)))
        return
    results = {}
    for variant in ("plain", "chunked"):
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--variant", variant]
        # glibc otherwise serves freed large blocks again from its heap without returning them, and the
        # resident set would over-count; a fixed mmap threshold maps and unmaps every large tensor.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(
            f"{variant:8s} peak extra memory {r['peak_extra_mb']:9.1f} MiB (over the start: {r['peak_over_start_mb']:9.1f} MiB)"
            f"   time {r['time_s']:7.3f} s   loss {r['loss']:.6f}"
        )
    plain, chunked = results["plain"], results["chunked"]
    summary = {
        "peak_mem_ratio": chunked["peak_extra_mb"] / plain["peak_extra_mb"],
        "time_ratio": chunked["time_s"] / plain["time_s"],
        "loss_rel_diff": abs(chunked["loss"] - plain["loss"]) / abs(plain["loss"]),
        "grad_norm_rel_diff": max(abs(c - p) / p for c, p in zip(chunked["grad_norms"], plain["grad_norms"])),
        "peak_over_start_ratio": chunked["peak_over_start_mb"] / plain["peak_over_start_mb"],
        "plain": {k: plain[k] for k in ("peak_extra_mb", "peak_over_start_mb", "time_s")},
        "chunked": {k: chunked[k] for k in ("peak_extra_mb", "peak_over_start_mb", "time_s")},
        "config": {k: getattr(args, k) for k in ("vocab", "hidden", "tokens", "chunk_size", "dtype", "device", "repeats")},
    }
    print(f"ratios (chunked / plain): peak memory {summary['peak_mem_ratio']:.3f}, time {summary['time_ratio']:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
