"""The GRPO example in one command: SFT (sft.yaml), then GRPO from its HF export (grpo.yaml); prints before and after.

    uv run python examples/qwen3vl-grpo-tiny/run.py [KEY=VALUE ...]

Two ordinary runs of `uv run apps/train` (2 CPU processes each, as the configs say), one after the other. The
overrides go to both stages, except `sft:KEY=VALUE` / `grpo:KEY=VALUE` (to that stage only: e.g. each stage's own
`data.dataset_param.basic_parameters.dataset_dir`) and `training.output_dir=DIR` (default
`outputs/qwen3vl-grpo-tiny`), which is the root of both: the SFT stage writes `DIR/sft` (its checkpoint in
`DIR/sft/ckpt`, the HF export in `DIR/sft/ckpt/hf/iter_N`) and the GRPO stage, which starts from that export
(`training.load`), writes `DIR/grpo` (its checkpoint and HF export in `DIR/grpo/ckpt`, `completions.jsonl`).
The end is `DIR/eval.json`: the GRPO stage's eval.json (`policy_accuracy`: the greedy answer's exact match on the
held-out images as the rollout engine decodes, media placeholders suppressed; `accuracy`: the argmax over the whole
vocabulary) with `start_policy_accuracy` / `start_accuracy` (the same numbers of the GRPO stage on its starting
weights, `training.eval_on_start`: "before"), `sft_accuracy` (the SFT stage's `accuracy`) and each stage's wall time. A stage that fails stops the script with its exit status. Run again, each stage does what
any run does (`mmfsdp.train.start`): a finished stage says so and exits 0 (its checkpoint, export and eval.json
stay), a stage stopped half-way resumes from its last checkpoint, so the script can be run twice in a row.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_OUT = "outputs/qwen3vl-grpo-tiny"


STAGES = ("sft", "grpo")


def split_overrides(overrides: list[str]) -> tuple[Path, list[str]]:
    """(the output root, the other overrides); an override without `=` is an error."""
    out, rest = Path(DEFAULT_OUT), []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"run.py: expected KEY=VALUE, got {item!r}")
        if key == "training.output_dir":
            out = Path(value)
        else:
            rest.append(item)
    return out, rest


def for_stage(overrides: list[str], stage: str) -> list[str]:
    """The overrides of one stage: the shared ones and its own `<stage>:KEY=VALUE`, in order."""
    mine = []
    for item in overrides:
        prefix, sep, rest = item.partition(":")
        if sep and prefix in STAGES:
            if prefix == stage:
                mine.append(rest)
        else:
            mine.append(item)
    return mine


def sft_iters(overrides: list[str]) -> int:
    """The SFT stage's `training.train_iters` (its HF export is `<save>/hf/iter_<that>`)."""
    iters = yaml.safe_load((HERE / "sft.yaml").read_text())["training"]["train_iters"]
    for item in for_stage(overrides, "sft"):
        key, _, value = item.partition("=")
        if key == "training.train_iters":
            iters = int(value)
    return iters


def stage_commands(out: Path, overrides: list[str]) -> tuple[list[str], list[str]]:
    """The two training commands: SFT into `out/sft`, then GRPO from its HF export into `out/grpo`."""
    sft_dir, grpo_dir = out / "sft", out / "grpo"
    export = sft_dir / "ckpt" / "hf" / f"iter_{sft_iters(overrides):07d}"
    app = ["uv", "run", "apps/train"]
    sft = [*app, str(HERE / "sft.yaml"), *for_stage(overrides, "sft"), f"training.output_dir={sft_dir}",
           f"training.save={sft_dir}/ckpt"]
    grpo = [*app, str(HERE / "grpo.yaml"), *for_stage(overrides, "grpo"), f"training.output_dir={grpo_dir}",
            f"training.save={grpo_dir}/ckpt"]
    return sft, [*grpo, f"training.load={export}"]


def main(argv: list[str] | None = None) -> int:
    out, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    out = out if out.is_absolute() else ROOT / out
    result: dict = {}
    for name, cmd in zip(STAGES, stage_commands(out, overrides)):
        print("$ " + " ".join(cmd), flush=True)
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        result[f"{name}_wall_s"] = round(time.monotonic() - start, 1)
        if rc:
            print(f"run.py: the {name} stage failed (exit status {rc})", file=sys.stderr)
            return rc
    sft_eval = json.loads((out / "sft" / "eval.json").read_text())
    grpo_eval = json.loads((out / "grpo" / "eval.json").read_text())
    start = json.loads((out / "grpo" / "eval_start.json").read_text())
    result = {**grpo_eval, "start_policy_accuracy": start["policy_accuracy"], "start_accuracy": start["accuracy"],
              "sft_accuracy": sft_eval["accuracy"], **result}
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"held-out accuracy {start['policy_accuracy']:.3f} after SFT -> {grpo_eval['policy_accuracy']:.3f} after GRPO "
        f"(chance {grpo_eval['chance']:.3f}); wall {result['sft_wall_s']:.0f} s + {result['grpo_wall_s']:.0f} s; "
        f"wrote {out / 'eval.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
