"""Token-budget micro-batches and data-parallel balance: simulated at scale, then measured on gloo processes.

    uv run python tools/bench/balance.py [--steps 20] [--samples-per-rank 16] [--procs 2 4] [--real-samples 200]
    uv run python tools/bench/balance.py --smoke        # the smallest run (CI): 2 steps, 2 processes, 16 samples

1. Simulation (the cost model, `mmfsdp.data.balance`, no model): a synthetic SFT mix (docs/data.md,
   "The benchmark workload": 35 % text-only rows, image rows with 1–8 images of 256–4,096 patches, 5 % video
   rows, 64–16k tokens) is planned for 8, 64 and 512 data-parallel ranks, `--samples-per-rank` samples per rank
   and step, three ways:

   - `fixed`: each rank takes its contiguous share of the step, `micro_batch_size` 4 samples per micro-batch,
     rows padded to the longest;
   - `budget`: the same shares, micro-batches of at most `micro_batch_tokens` (16,384) tokens, packed;
   - `balanced`: the budget, with the step's samples assigned to ranks by the cost model.

   Per step the cost of each rank is what the cost model says of its micro-batches as they run (padding and
   filler micro-batches included): `straggler_<D>_<strategy>` is the mean over steps of max/mean rank cost,
   `padding_fraction_<D>_<strategy>` the share of row tokens that are padding or filler.

2. Measured: `--procs` gloo processes (one thread each) each run forward + backward of a small vision-language
   stand-in (a ViT over each image's patches with attention per image, a causal decoder over the tokens) on
   their share of a variable-length image workload, step by step with a barrier after each step (what FSDP's
   collectives impose); wall time per 100 samples unbalanced (the fixed layout) vs balanced (budget + balance),
   `wall_ratio_<P>` = balanced / unbalanced, and the correlation between the cost model's predicted rank time
   and the measured one over all (step, rank) pairs (`cost_model_correlation_<P>`), with the model calibrated
   on this machine first (`balance_calibrate.fit`). More processes than CPU cores still run (the JSON marks
   `oversubscribed_<P>`): the ranks time-share the cores, so their measured times include waiting for one.

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _smoke import parse_args  # noqa: E402

from mmfsdp.data.balance import CostModel, SampleStats, is_filler, plan_step  # noqa: E402

RANKS = (8, 64, 512)
MICRO_BATCH_SIZE = 4
BUDGET = 16384


def sft_mix(num: int, seed: int) -> SampleStats:
    """The synthetic heavy-tailed SFT mix of docs/data.md ("The benchmark workload")."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=num, p=[0.35, 0.60, 0.05])  # text-only, images, video
    text = np.clip(rng.lognormal(math.log(400), 1.0, num), 64, 16384).astype(np.int64)
    patches = np.zeros(num, dtype=np.int64)
    patch_sq = np.zeros(num, dtype=np.int64)
    for i in np.flatnonzero(kind == 1):
        count = int(rng.choice([1, 2, 3, 4, 6, 8], p=[0.6, 0.15, 0.1, 0.07, 0.05, 0.03]))
        sizes = np.exp(rng.uniform(math.log(256), math.log(4096), count)).astype(np.int64)
        patches[i], patch_sq[i] = sizes.sum(), (sizes * sizes).sum()
    for i in np.flatnonzero(kind == 2):
        groups = int(rng.integers(8, 33))
        size = int(rng.choice([256, 576, 1024]))
        patches[i], patch_sq[i] = groups * size, groups * size * size
    tokens = np.minimum(text + patches // 4, 16384)  # 2 × 2 merge: a token per 4 patches
    return SampleStats(tokens, patches, patch_sq)


def _waste(plan, stats: SampleStats, packing: bool) -> tuple[int, int]:
    """(row tokens, padding + filler tokens) of a plan."""
    rows = waste = 0
    for micro_batches in plan.ranks:
        for mb in micro_batches:
            entries = [i for row in mb for i in row]
            if any(is_filler(i) for i in entries):
                n = int(stats.tokens[-1 - entries[0]])
                rows, waste = rows + n, waste + n
                continue
            lengths = [int(stats.tokens[i]) for i in entries]
            spent = sum(lengths) if packing else len(lengths) * max(lengths)
            rows, waste = rows + spent, waste + spent - sum(lengths)
    return rows, waste


STRATEGIES = {
    "fixed": dict(micro_batch_tokens=None, balance=False, packing=False),
    "budget": dict(micro_batch_tokens=BUDGET, balance=False, packing=True),
    "balanced": dict(micro_batch_tokens=BUDGET, balance=True, packing=True),
}


def simulate(steps: int, samples_per_rank: int, cost: CostModel, seed: int = 0) -> dict[str, float]:
    out: dict[str, float] = {}
    for num_ranks in RANKS:
        per_step = num_ranks * samples_per_rank
        stats = sft_mix(per_step * steps, seed)
        for name, strategy in STRATEGIES.items():
            stragglers, rows, waste = [], 0, 0
            for s in range(steps):
                plan = plan_step(range(s * per_step, (s + 1) * per_step), stats, dp_size=num_ranks,
                                 micro_batch_size=MICRO_BATCH_SIZE, cost_model=cost, **strategy)
                stragglers.append(plan.imbalance)
                r, w = _waste(plan, stats, strategy["packing"])
                rows, waste = rows + r, waste + w
            out[f"straggler_{num_ranks}_{name}"] = round(float(np.mean(stragglers)), 4)
            out[f"padding_fraction_{num_ranks}_{name}"] = round(waste / rows, 4)
    for name in STRATEGIES:
        out[f"padding_fraction_{name}"] = out[f"padding_fraction_64_{name}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples-per-rank", type=int, default=16)
    parser.add_argument("--procs", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--real-samples", type=int, default=192)
    parser.add_argument("--calibration-micro-batches", type=int, default=40)
    args = parse_args(parser, steps=2, samples_per_rank=4, procs=[2], real_samples=16, calibration_micro_batches=8)
    result: dict[str, float | int | str] = {"samples_per_rank": args.samples_per_rank, "steps": args.steps}
    started = time.perf_counter()
    result.update(simulate(args.steps, args.samples_per_rank, CostModel()))
    result["simulation_s"] = round(time.perf_counter() - started, 1)
    for key in sorted(k for k in result if k.startswith("straggler_")):
        print(f"{key}: {result[key]}  padding {result[key.replace('straggler', 'padding_fraction')]}")
    if args.procs:
        from balance_calibrate import calibrate, measure

        result["cpu_count"] = os.cpu_count() or 0
        measured_cost, r2 = calibrate(args.calibration_micro_batches)
        result["calibration_r2"] = round(r2, 4)
        result["calibrated_cost_model"] = measured_cost.to_dict()
        for procs in args.procs:
            if procs > result["cpu_count"]:  # valid but slow: the ranks time-share the cores, which the barrier absorbs
                print(f"{procs} processes on {result['cpu_count']} CPU cores: oversubscribed")
                result[f"oversubscribed_{procs}"] = True
            result.update(measure(procs, args.real_samples, measured_cost))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
