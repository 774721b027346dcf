"""Calibrate the balance cost model (`mmfsdp.data.balance.CostModel`) against measured step times.

    uv run python tools/bench/balance_calibrate.py [--micro-batches 60] [--out cost.json]
    uv run python tools/bench/balance_calibrate.py --smoke      # the smallest run (CI): 8 micro-batches

A small vision-language stand-in (`StandIn`: a 2-layer ViT whose attention runs per image over that image's
patches, a projector, a 2-layer causal decoder whose attention runs per sample, as packed varlen attention
does; width 64, fp32, one thread) runs forward + backward on random micro-batches of variable-length samples
with 0–4 images each. Each micro-batch's seconds (best of 3) are fitted by non-negative least squares to

    seconds = micro_batch + sample · S + token · Σ n + token_sq · Σ n² + patch · Σ p + patch_sq · Σ p²

(`n` tokens per sample, `p` patches per image), the terms of `CostModel.micro_batch_cost` for packed rows.
The fit and its R² are printed; `--out` writes the coefficients as JSON (`data.dataloader_param.cost_model`
reads that file). The defaults of `CostModel` come from this script on the project's 2-core CPU
(docs/data.md, "The cost model"). For a real model, calibrate with its own step times in the same way.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from _smoke import parse_args
from torch import nn

from mmfsdp.data.balance import CostModel

WIDTH = 64


class StandIn(nn.Module):
    """Vision encoder per image, decoder per sample (causal), one loss over all tokens."""

    def __init__(self) -> None:
        super().__init__()
        layer = lambda: nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)  # noqa: E731
        self.vision = nn.ModuleList([layer() for _ in range(2)])
        self.projector = nn.Linear(WIDTH, WIDTH)
        self.decoder = nn.ModuleList([layer() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 256)

    def forward(self, samples: list[tuple[int, list[int]]]) -> torch.Tensor:
        loss = torch.zeros(())
        for tokens, images in samples:
            for patches in images:
                x = torch.randn(1, patches, WIDTH)
                for block in self.vision:
                    x = block(x)
                loss = loss + self.projector(x).mean()
            h = torch.randn(1, tokens, WIDTH)
            mask = nn.Transformer.generate_square_subsequent_mask(tokens)
            for block in self.decoder:
                h = block(h, src_mask=mask, is_causal=True)
            logits = self.head(h)
            loss = loss + nn.functional.cross_entropy(logits.view(-1, 256), torch.zeros(tokens, dtype=torch.long))
        return loss


def run_micro_batch(model: StandIn, samples: list[tuple[int, list[int]]]) -> float:
    """Seconds of one forward + backward."""
    started = time.perf_counter()
    model(samples).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def random_sample(rng: np.random.Generator) -> tuple[int, list[int]]:
    """A variable-length sample of the measured workload: 32–1,024 tokens, 0–4 images of 16–256 patches."""
    tokens = int(np.exp(rng.uniform(np.log(32), np.log(1024))))
    count = int(rng.choice(5, p=[0.35, 0.35, 0.15, 0.1, 0.05]))
    return tokens, [int(np.exp(rng.uniform(np.log(16), np.log(256)))) for _ in range(count)]


def features(samples: list[tuple[int, list[int]]]) -> list[float]:
    n = np.array([t for t, _ in samples], dtype=np.float64)
    p = np.array([q for _, images in samples for q in images] or [0], dtype=np.float64)
    return [1.0, len(samples), n.sum(), (n * n).sum(), p.sum(), (p * p).sum()]


def fit(rows: list[list[float]], seconds: list[float]) -> tuple[CostModel, float]:
    """Non-negative least squares (projected gradient on the scaled columns); the model and the fit's R²."""
    a = np.asarray(rows)
    y = np.asarray(seconds)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    x_scaled = a / scale
    coef = np.clip(np.linalg.lstsq(x_scaled, y, rcond=None)[0], 0, None)
    step = 1.0 / np.linalg.norm(x_scaled, 2) ** 2
    for _ in range(20000):
        coef = np.clip(coef - step * x_scaled.T @ (x_scaled @ coef - y), 0, None)
    r2 = 1 - float(((x_scaled @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    values = coef / scale
    keys = ("micro_batch", "sample", "token", "token_sq", "patch", "patch_sq")
    return CostModel(**{k: float(v) for k, v in zip(keys, values)}), r2


def calibrate(num_micro_batches: int, seed: int = 0) -> tuple[CostModel, float]:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = StandIn()
    run_micro_batch(model, [random_sample(rng)])  # warm-up
    rows, seconds = [], []
    for _ in range(num_micro_batches):
        samples = [random_sample(rng) for _ in range(int(rng.integers(1, 5)))]
        rows.append(features(samples))
        seconds.append(min(run_micro_batch(model, samples) for _ in range(3)))
    return fit(rows, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, default=60)
    parser.add_argument("--out", default=None)
    args = parse_args(parser, micro_batches=8)
    model, r2 = calibrate(args.micro_batches)
    print(f"fit R² {r2:.3f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(model.to_dict(), fh, indent=2)
    print(json.dumps({**model.to_dict(), "r2": round(r2, 4)}))


if __name__ == "__main__":
    main()


def _measure_rank(rank: int, world_size: int, cost_json: str, num_samples: int, samples_per_rank: int) -> dict:
    """One gloo rank: every strategy's steps on its share, a barrier after each step (FSDP's collectives)."""
    import torch.distributed as dist

    from mmfsdp.data.balance import SampleStats, is_filler, plan_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cost = CostModel(**json.loads(cost_json))
    rng = np.random.default_rng(1)
    samples = [random_sample(rng) for _ in range(num_samples)]
    stats = SampleStats(
        np.array([t for t, _ in samples]), np.array([sum(i) for _, i in samples]),
        np.array([sum(q * q for q in i) for _, i in samples]),
    )
    model = StandIn()
    run_micro_batch(model, [samples[0]])
    per_step = samples_per_rank * world_size
    out: dict = {}
    strategies = {"unbalanced": dict(micro_batch_tokens=None, balance=False, packing=False),
                  "balanced": dict(micro_batch_tokens=4096, balance=True, packing=True)}
    for name, strategy in strategies.items():
        dist.barrier()
        started = time.perf_counter()
        measured, predicted = [], []
        for s in range(num_samples // per_step):
            plan = plan_step(range(s * per_step, (s + 1) * per_step), stats, dp_size=world_size, micro_batch_size=4,
                             cost_model=cost, **strategy)
            compute = time.perf_counter()
            for mb in plan.ranks[rank]:
                members = [i for row in mb for i in row]
                if strategy["packing"]:
                    batch = [(samples[-1 - i] if is_filler(i) else samples[i]) for i in members]
                else:  # padded rows: every sample at the micro-batch's longest length
                    longest = max(samples[i][0] for i in members)
                    batch = [(longest, samples[i][1]) for i in members]
                run_micro_batch(model, batch)
            measured.append(time.perf_counter() - compute)
            predicted.append(float(plan.rank_costs[rank]))
            dist.barrier()
        out[name] = {"wall_s": time.perf_counter() - started, "samples": int((num_samples // per_step) * per_step),
                     "measured": measured, "predicted": predicted}
    return out


def measure(procs: int, num_samples: int, cost: CostModel, samples_per_rank: int = 8) -> dict[str, float]:
    """Wall time per 100 samples, unbalanced (fixed layout, padded) vs balanced (budget + balance, packed), on
    `procs` gloo processes, and the correlation of predicted and measured rank compute times."""
    from mmfsdp.parallel.testing import run_distributed

    per_rank = run_distributed(_measure_rank, procs, json.dumps(cost.to_dict()), num_samples, samples_per_rank,
                               timeout=1800)
    out: dict[str, float] = {}
    for name in ("unbalanced", "balanced"):
        wall = max(r[name]["wall_s"] for r in per_rank)
        out[f"wall_per_100_samples_{name}_{procs}"] = round(wall / per_rank[0][name]["samples"] * 100, 3)
    out[f"wall_ratio_{procs}"] = round(
        out[f"wall_per_100_samples_balanced_{procs}"] / out[f"wall_per_100_samples_unbalanced_{procs}"], 3
    )
    measured = [t for r in per_rank for name in ("unbalanced", "balanced") for t in r[name]["measured"]]
    predicted = [t for r in per_rank for name in ("unbalanced", "balanced") for t in r[name]["predicted"]]
    out[f"cost_model_correlation_{procs}"] = round(float(np.corrcoef(measured, predicted)[0, 1]), 3)
    for name in ("unbalanced", "balanced"):
        steps = zip(*[r[name]["measured"] for r in per_rank])
        out[f"measured_straggler_{name}_{procs}"] = round(float(np.mean([max(s) / np.mean(s) for s in steps])), 3)
    return out
