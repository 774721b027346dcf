"""The two-stage examples' driver (examples/qwen3vl-dpo-tiny/run.py, examples/qwen3vl-grpo-tiny/run.py): SFT, then
a second stage (DPO or GRPO) that starts from SFT's HF export.

Each stage is an ordinary run of the app, `uv run apps/train CONFIG KEY=VALUE ...` (the command is printed before it
starts, so it can be run by hand the same way). The stages run one after the other, each in a process forked from
the script after it has imported the app once (`mmfsdp.train.cli.fork_main`: the app's `main` with the stage's
arguments, exactly what `apps/train` runs): the second stage does not start and import a second interpreter. On a
host with an accelerator nothing here touches its driver before the fork (importing torch does not), and the app
starts its ranks there as always (torchrun's way, fresh processes).

Overrides (`KEY=VALUE`) go to both stages, `<stage>:KEY=VALUE` to that stage only, and `training.output_dir=DIR` is
the root of both: the SFT stage writes `DIR/sft` (its checkpoint in `DIR/sft/ckpt`, the HF export in
`DIR/sft/ckpt/hf/iter_N`), the second stage `DIR/<stage>` (its checkpoint and export in `DIR/<stage>/ckpt`) with
`training.load` = that export. A stage that fails stops the script with its exit status. Run again, each stage does
what any run does (`mmfsdp.train.start`): a finished stage says so and exits 0, a stage stopped half-way resumes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def split_overrides(overrides: list[str], default_out: str) -> tuple[Path, list[str]]:
    """(the output root, absolute, the other overrides); an override without `=` is an error."""
    out, rest = Path(default_out), []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"run.py: expected KEY=VALUE, got {item!r}")
        if key == "training.output_dir":
            out = Path(value)
        else:
            rest.append(item)
    return (out if out.is_absolute() else ROOT / out), rest


def for_stage(overrides: list[str], stage: str, stages: tuple[str, ...]) -> list[str]:
    """The overrides of one stage: the shared ones and its own `<stage>:KEY=VALUE`, in order."""
    mine = []
    for item in overrides:
        prefix, sep, rest = item.partition(":")
        if sep and prefix in stages:
            if prefix == stage:
                mine.append(rest)
        else:
            mine.append(item)
    return mine


def stage_commands(example: Path, second: str, out: Path, overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(stage, the app's arguments) of both stages: SFT (`example/sft.yaml`) into `out/sft`, then `second`
    (`example/<second>.yaml`) into `out/<second>` from SFT's HF export."""
    stages = ("sft", second)
    sft_args = for_stage(overrides, "sft", stages)
    iters = yaml.safe_load((example / "sft.yaml").read_text())["training"]["train_iters"]
    for item in sft_args:
        key, _, value = item.partition("=")
        if key == "training.train_iters":
            iters = int(value)
    export = out / "sft" / "ckpt" / "hf" / f"iter_{iters:07d}"
    commands = []
    for stage in stages:
        args = [str(example / f"{stage}.yaml"), *for_stage(overrides, stage, stages),
                f"training.output_dir={out / stage}", f"training.save={out / stage}/ckpt"]
        commands.append((stage, args if stage == "sft" else [*args, f"training.load={export}"]))
    return commands


def run_stages(example: Path, second: str, default_out: str, argv: list[str]) -> tuple[Path, dict[str, float]] | int:
    """Run both stages; (the output root, each stage's wall seconds as `<stage>_wall_s`), or the exit status of
    the stage that failed."""
    from mmfsdp.train.cli import fork_main

    out, overrides = split_overrides(argv, default_out)
    walls: dict[str, float] = {}
    for stage, args in stage_commands(example, second, out, overrides):
        print("$ uv run apps/train " + " ".join(args), flush=True)
        started = time.monotonic()
        code = fork_main(args, cwd=ROOT)
        walls[f"{stage}_wall_s"] = round(time.monotonic() - started, 1)
        if code:
            print(f"run.py: the {stage} stage failed (exit status {code})", file=sys.stderr)
            return code
    return out, walls
