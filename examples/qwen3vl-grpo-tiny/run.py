"""The GRPO example in one command: SFT (sft.yaml), then GRPO from its HF export (grpo.yaml); prints before and after.

    uv run python examples/qwen3vl-grpo-tiny/run.py [KEY=VALUE ...]

Two ordinary runs of `uv run apps/train` (2 CPU processes each, as the configs say), one after the other, each
forked from this script after it imported the app once (`examples/two_stage.py`). The
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
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/two_stage.py

from two_stage import run_stages  # noqa: E402

DEFAULT_OUT = "outputs/qwen3vl-grpo-tiny"


def main(argv: list[str] | None = None) -> int:
    ran = run_stages(HERE, "grpo", DEFAULT_OUT, sys.argv[1:] if argv is None else argv)
    if isinstance(ran, int):
        return ran
    out, result = ran
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
