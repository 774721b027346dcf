"""Benchmark our packed chunked gated delta rule against HF's torch fallback run per sample.

Both compute the Gated DeltaNet's delta rule (l2-normalised q/k, chunk 64, fp32 inside) of one packed row of
`--tokens` tokens cut into `--samples` samples of equal length, forward + backward (the gradients of q, k, v, g,
β), from zero states:

    ours  mmfsdp.model.gated_delta_rule.chunk_gated_delta_rule_packed over the whole row, with the micro-batch's
          `SegmentPlan` (made once, as the training forward does, outside the timed region)
    hf    transformers' `torch_chunk_gated_delta_rule` (what HF's Qwen3.5 layer runs without fla) on each sample
          alone: HF's fallback ignores sample boundaries, so per sample is how it computes a packed row exactly

Time: the two alternate, `--repeats` rounds after a warm-up each; the median round is reported. Peak memory: on an
accelerator the allocator's peak over the step; on the CPU the peak of live tensor bytes during the step
(`mmfsdp.parallel.tensor_memory.TensorMemory`, a separate untimed run), both above what is held before it (the
inputs). Ratios are ours / HF (target ≤ 1.0 each); their outputs agree to `max_relative_diff`.

    uv run python tools/bench/gated_deltanet.py                 # CPU: 4096 and 16384 tokens, 1 and 8 samples
    uv run python tools/bench/gated_deltanet.py --device cuda --key-heads 16 --value-heads 32
    uv run python tools/bench/gated_deltanet.py --smoke         # the smallest run (CI)

The last line printed is one JSON object: per case (`<tokens>x<samples>`) the times, peaks and ratios, and the
worst time and memory ratios over the cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _smoke import parse_args

from mmfsdp.model.gated_delta_rule import SegmentPlan, chunk_gated_delta_rule_packed
from mmfsdp.parallel.device import synchronize
from mmfsdp.parallel.tensor_memory import TensorMemory


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens in the packed row")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8], help="samples the row is cut into")
    parser.add_argument("--key-heads", type=int, default=2, help="q/k heads (Qwen3.5-27B: 16; a Ulysses shard here)")
    parser.add_argument("--value-heads", type=int, default=4, help="value heads (Qwen3.5-27B: 48)")
    parser.add_argument("--head-dim", type=int, default=128, help="q/k and value head size (Qwen3.5: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="input dtype (the math is fp32)")
    return parser


def _inputs(args, tokens: int, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    Hk, Hv, d = args.key_heads, args.value_heads, args.head_dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    q, k, v = rand(tokens, Hk, d), rand(tokens, Hk, d), rand(tokens, Hv, d)
    g = -torch.rand(tokens, Hv, generator=generator).to(device) * 0.5  # decay in log space, <= 0
    beta = torch.rand(tokens, Hv, generator=generator).to(device=device, dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def _ours(inputs, plan: SegmentPlan):
    q, k, v, g, beta = inputs
    out, _ = chunk_gated_delta_rule_packed(q, k, v, g, beta, plan.starts, plan.lens, plan=plan)
    return out


def _hf(inputs, plan: SegmentPlan):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    outs = []
    for start, length in zip(plan.starts, plan.lens):
        piece = [x[start : start + length].unsqueeze(0) for x in inputs]
        out, _ = torch_chunk_gated_delta_rule(*piece, chunk_size=plan.chunk, use_qk_l2norm_in_kernel=True)
        outs.append(out[0])
    return torch.cat(outs)


VARIANTS = {"ours": _ours, "hf": _hf}


def _step(fn, inputs, plan, cotangent) -> torch.Tensor:
    for x in inputs:
        x.grad = None
    out = fn(inputs, plan)
    (out.float() * cotangent).sum().backward()
    return out.detach()


def _peak_bytes(fn, inputs, plan, cotangent, device: torch.device) -> int:
    """The most memory alive at once during one step, above what was alive before it."""
    for x in inputs:
        x.grad = None
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _step(fn, inputs, plan, cotangent)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with TensorMemory(device.type) as memory:
        _step(fn, inputs, plan, cotangent)
    return memory.peak


def _case(args, tokens: int, samples: int, device: torch.device, dtype: torch.dtype) -> dict:
    length = tokens // samples
    plan = SegmentPlan([i * length for i in range(samples)], [length] * samples, 1, device)
    inputs = _inputs(args, samples * length, device, dtype)
    generator = torch.Generator().manual_seed(1)
    cotangent = torch.randn(samples * length, args.value_heads, args.head_dim, generator=generator).to(device)
    results = {name: _step(fn, inputs, plan, cotangent) for name, fn in VARIANTS.items()}  # warm-up
    grads = {}
    for name, fn in VARIANTS.items():
        _step(fn, inputs, plan, cotangent)
        grads[name] = [x.grad.clone() for x in inputs]
    diff = max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
        for a, b in zip([results["ours"], *grads["ours"]], [results["hf"], *grads["hf"]])
    )
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, fn in VARIANTS.items():
            synchronize(device)
            start = time.perf_counter()
            _step(fn, inputs, plan, cotangent)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    peaks = {name: _peak_bytes(fn, inputs, plan, cotangent, device) for name, fn in VARIANTS.items()}
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "time_s": {name: round(value, 4) for name, value in median.items()},
        "peak_mb": {name: round(value / 2**20, 2) for name, value in peaks.items()},
        "time_ratio": round(median["ours"] / median["hf"], 3),
        "mem_ratio": round(peaks["ours"] / peaks["hf"], 3),
        "max_relative_diff": diff,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(_parser(), argv, tokens=[256], samples=[1, 4], head_dim=32, repeats=1)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    cases = {}
    for tokens in args.tokens:
        for samples in args.samples:
            cases[f"{tokens}x{samples}"] = case = _case(args, tokens, samples, device, dtype)
            print(f"{tokens} tokens, {samples} samples: {json.dumps(case)}", flush=True)
    result = {
        "device": device.type,
        "dtype": args.dtype,
        "heads": {"key": args.key_heads, "value": args.value_heads, "dim": args.head_dim},
        "cases": cases,
        "worst_time_ratio": max(case["time_ratio"] for case in cases.values()),
        "worst_mem_ratio": max(case["mem_ratio"] for case in cases.values()),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
