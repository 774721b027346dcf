"""Train the tiny examples over seeds × batch layouts and print their held-out accuracies.

    uv run python examples/run_matrix.py --examples video --seeds 1,2,3 --layouts padded,padding_free

Each cell is one ordinary run, `uv run apps/train examples/<name>/config.yaml training.seed=S
data.dataloader_param.padding_free=true|false training.output_dir=<out>/<name>/s<S>_<layout>` (2 CPU processes, as
the config says), after the video example's `make_assets.py` once (it writes that example's data; the others'
`make_assets.py` rewrite their committed model directories and are not run). The cell's accuracy is the run's
`eval.json`; its wall time is the training command's, start-up, first-run data generation and evaluation included.
The runs go one after the other. The end is a table and one JSON line (`{"matrix": [...]}`) with every cell; a
failed run is a row with its exit status, and the script exits 1 if any run failed or any accuracy is below
`--min-accuracy`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "tiny": "tiny",
    "qwen3vl": "qwen3vl-tiny",
    "moe": "qwen3vl-moe-tiny",
    "video": "qwen3vl-video-tiny",
    "dpo": "qwen3vl-dpo-tiny",
    "grpo": "qwen3vl-grpo-tiny",
    "qwen3_5": "qwen3_5-tiny",
    "qwen3_5_moe": "qwen3_5-moe-tiny",
    "omni": "qwen3omni-tiny",
}
"""Short name -> directory under examples/ (the directory name is accepted too)."""
WRITES_DATA = {"qwen3vl-video-tiny"}
"""Examples whose `make_assets.py` writes the training data (run once before their cells); the others' commit their
model directory and generate their data on the first run (inside the first cell's wall time)."""
DRIVERS = {"qwen3vl-dpo-tiny": ("run.py", "dpo"), "qwen3vl-grpo-tiny": ("run.py", "grpo")}
"""Examples run by a script of theirs (`uv run python examples/<name>/<script>`, with the same overrides) instead of
`uv run apps/train examples/<name>/config.yaml`, and the stage directory under `<output_dir>` whose metrics.jsonl
gives the last loss; the script writes `<output_dir>/eval.json` as a run does."""
CLAIMS = {"qwen3vl-dpo-tiny": "reward_accuracy", "qwen3vl-grpo-tiny": "policy_accuracy"}
"""Examples whose claimed number (checked against `--min-accuracy`) is another key of eval.json than `accuracy`."""
LAYOUTS = {"padded": "false", "padding_free": "true"}
"""Layout name -> `data.dataloader_param.padding_free`."""


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--examples", default="video,tiny,qwen3vl,moe,qwen3_5,qwen3_5_moe", help="comma list of " + ", ".join(EXAMPLES)
    )
    parser.add_argument("--seeds", default="1,2,3", help="comma list of training.seed values")
    parser.add_argument("--layouts", default="padded,padding_free", help="comma list of " + ", ".join(LAYOUTS))
    parser.add_argument("--out", default=str(ROOT / "outputs" / "matrix"), help="where each run's output_dir goes")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 if a cell is below this")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("overrides", nargs="*", help="extra KEY=VALUE overrides for every run")
    args = parser.parse_args(argv)
    names = {**EXAMPLES, **{d: d for d in EXAMPLES.values()}}
    args.examples = _csv(args.examples)
    for name in args.examples:
        if name not in names:
            parser.error(f"--examples: unknown example {name!r} (known: {', '.join(names)})")
    args.examples = [names[name] for name in args.examples]
    try:
        args.seeds = [int(seed) for seed in _csv(args.seeds)]
    except ValueError:
        parser.error(f"--seeds: expected a comma list of integers, got {args.seeds!r}")
    args.layouts = _csv(args.layouts)
    for layout in args.layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    return args


def train_command(example: str, seed: int, layout: str, out_dir: Path, overrides: list[str]) -> list[str]:
    if example in DRIVERS:
        start = ["uv", "run", "python", f"examples/{example}/{DRIVERS[example][0]}"]
    else:
        start = ["uv", "run", "apps/train", f"examples/{example}/config.yaml"]
    return [
        *start, f"training.seed={seed}",
        f"data.dataloader_param.padding_free={LAYOUTS[layout]}", f"training.output_dir={out_dir}", *overrides,
    ]  # fmt: skip


def run_cell(example: str, seed: int, layout: str, out_root: Path, overrides: list[str]) -> dict:
    out_dir = out_root / example / f"s{seed}_{layout}"
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_path = out_dir / "eval.json"
    eval_path.unlink(missing_ok=True)
    cmd = train_command(example, seed, layout, out_dir, overrides)
    print("$ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(out_dir / "run.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    cell = {"example": example, "seed": seed, "layout": layout, "rc": rc, "wall_s": round(wall, 1)}
    if rc == 0 and eval_path.exists():
        result = json.loads(eval_path.read_text())
        cell.update(accuracy=result["accuracy"], chance=result.get("chance"), num_samples=result.get("num_samples"))
        cell.update({key: result[key] for key in ("reward_accuracy", "sft_accuracy", "policy_accuracy",
                                                  "start_policy_accuracy") if key in result})
    final_loss = _final_loss(out_dir / (DRIVERS[example][1] if example in DRIVERS else "") / "metrics.jsonl")
    if final_loss is not None:
        cell["final_loss"] = final_loss
    print(f"  -> {_row(cell)}", flush=True)
    return cell


def _final_loss(path: Path) -> float | None:
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [row["loss"] for row in rows if "loss" in row]
    return round(losses[-1], 4) if losses else None


def _row(cell: dict) -> str:
    acc = f"{cell['accuracy']:.3f}" if "accuracy" in cell else f"failed (rc {cell['rc']})"
    if "reward_accuracy" in cell:
        acc += f" (SFT {cell['sft_accuracy']:.3f}; reward accuracy {cell['reward_accuracy']:.3f})"
    elif "policy_accuracy" in cell:
        acc = (f"{cell['start_policy_accuracy']:.3f} -> {cell['policy_accuracy']:.3f} as the engine decodes "
               f"(whole vocabulary: SFT {cell['sft_accuracy']:.3f} -> {cell['accuracy']:.3f})")
    elif "sft_accuracy" in cell:
        acc += f" (SFT {cell['sft_accuracy']:.3f})"
    loss = f"{cell['final_loss']:.4f}" if "final_loss" in cell else "-"
    return f"| {cell['example']} | {cell['seed']} | {cell['layout']} | {acc} | {loss} | {cell['wall_s']:.0f} s |"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_root = Path(args.out).resolve()
    if args.dry_run:
        for example in args.examples:
            for seed in args.seeds:
                for layout in args.layouts:
                    out_dir = out_root / example / f"s{seed}_{layout}"
                    print(" ".join(train_command(example, seed, layout, out_dir, args.overrides)))
        return 0
    cells = []
    for example in args.examples:
        if example in WRITES_DATA:
            assets = subprocess.run(["uv", "run", "python", f"examples/{example}/make_assets.py"], cwd=ROOT)
            if assets.returncode:
                print(f"examples/{example}/make_assets.py failed (rc {assets.returncode})", file=sys.stderr)
                return 1
        for seed in args.seeds:
            for layout in args.layouts:
                cells.append(run_cell(example, seed, layout, out_root, args.overrides))
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print("| example | seed | layout | held-out accuracy | last logged loss | wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for cell in cells:
        print(_row(cell))
    print(json.dumps({"matrix": cells}))
    ok = all(cell.get(CLAIMS.get(cell["example"], "accuracy"), -1.0) >= args.min_accuracy for cell in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
