"""Every fast example's README command runs twice in a row (CONVENTIONS: "Every command a README shows works when
run twice in a row"), each time as the README gives it with tiny sizes as command-line overrides: 2 steps, 32 rows.

- The examples that train without `training.save` (tiny, qwen3vl-tiny, qwen3vl-moe-tiny, qwen3vl-video-tiny, qwen3omni-tiny,
  qwen3_5-tiny, qwen3_5-moe-tiny) train again into the same output directory; the video example's `make_assets.py`
  keeps the data it wrote the first time.
- `examples/qwen3vl-dpo-tiny/run.py` saves both stages without optimizer state (`no_save_optim`): run again, each
  finished stage says so and exits 0 (it used to resume the SFT checkpoint and fail for its missing optimizer
  state), and the script ends as the first run did.
- `examples/qwen3vl-grpo-tiny/run.py` likewise (SFT, then GRPO from its export).
- `examples/magistral-2509/smoke.yaml` (the laptop command of its README) saves as it trains: run again, it says
  it is finished.
- A run with `training.save` that finished says so and starts no rank; raised `training.train_iters`, the same
  command resumes it (a half-finished run).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import apprun
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FINISHED = "start: the run is finished: "
TRAIN_EXAMPLES = {
    "tiny": apprun.TINY,
    "qwen3vl-tiny": apprun.QWEN,
    "qwen3vl-moe-tiny": apprun.MOE,
    "qwen3_5-tiny": apprun.QWEN3_5,
    "qwen3_5-moe-tiny": apprun.EXAMPLES / "qwen3_5-moe-tiny" / "config.yaml",
    "qwen3omni-tiny": apprun.EXAMPLES / "qwen3omni-tiny" / "config.yaml",
}
"""Examples whose README command is `uv run apps/train examples/<name>/config.yaml`."""


def _tiny(tmp: Path, out: Path, **extra) -> dict:
    return {**apprun.synthetic_items(tmp, num_train=32, num_eval=8), **apprun.run_items(out, steps=2),
            "training.eval_batch_size": 4, **extra}  # fmt: skip


def _twice(cmd: list[str]) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return apprun.run(cmd), apprun.run(cmd)


@pytest.mark.parametrize("name", sorted(TRAIN_EXAMPLES))
def test_an_example_without_save_trains_again(tmp_path, name):
    out = tmp_path / "out"
    first, second = _twice(apprun.command(TRAIN_EXAMPLES[name], _tiny(tmp_path, out)))
    assert FINISHED not in second.stdout + second.stderr
    assert json.loads((out / "eval.json").read_text())["num_samples"] == 8
    assert apprun.logged_steps(out) == [1, 2] and len(list(out.glob("metrics.*.jsonl"))) == 1  # the first run's


def test_the_video_example_twice(tmp_path):
    script = apprun.EXAMPLES / "qwen3vl-video-tiny" / "make_assets.py"
    spec = importlib.util.spec_from_file_location("video_make_assets", script)
    make_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_assets)
    data, out = tmp_path / "data", tmp_path / "out"
    metas = [make_assets.main(data, num_train=32, num_eval=8) for _ in range(2)]  # the second keeps the first's data
    assert metas[0] == metas[1]
    items = {**_tiny(tmp_path, out), "data.dataset_param.basic_parameters.dataset": data / "train.jsonl",
             "data.dataset_param.basic_parameters.eval_dataset": data / "eval.jsonl"}  # fmt: skip
    _twice(apprun.command(apprun.EXAMPLES / "qwen3vl-video-tiny" / "config.yaml", items))
    assert json.loads((out / "eval.json").read_text())["num_samples"] == 8


def _two_stage_command(tmp_path: Path, out: Path, example: str, stages: tuple[str, str]) -> list[str]:
    """A two-stage example's `run.py` with tiny sizes for both stages and each stage's own data and cache."""
    stage_data = [f"{stage}:{key}={tmp_path / stage / part}" for stage in stages
                  for key, part in (("data.dataset_param.basic_parameters.dataset_dir", "data"),
                                    ("data.dataset_param.basic_parameters.cache_dir", "cache"))]  # fmt: skip
    sizes = {key: value for key, value in _tiny(tmp_path, out).items() if "basic_parameters" not in key}
    return [sys.executable, str(apprun.EXAMPLES / example / "run.py"), *apprun.overrides(sizes), *stage_data]


def test_the_dpo_example_twice(tmp_path):
    out = tmp_path / "out"
    first, second = _twice(_two_stage_command(tmp_path, out, "qwen3vl-dpo-tiny", ("sft", "dpo")))
    assert first.stdout.count(FINISHED) == 0 and second.stdout.count(FINISHED) == 2, second.stdout[-3000:]
    assert "held-out accuracy" in second.stdout
    result = json.loads((out / "eval.json").read_text())
    assert {"accuracy", "reward_accuracy", "sft_accuracy"} <= set(result)


def test_the_grpo_example_twice(tmp_path):
    out = tmp_path / "out"
    first, second = _twice(_two_stage_command(tmp_path, out, "qwen3vl-grpo-tiny", ("sft", "grpo")))
    assert first.stdout.count(FINISHED) == 0 and second.stdout.count(FINISHED) == 2, second.stdout[-3000:]
    assert "held-out accuracy" in second.stdout and "after GRPO" in second.stdout
    result = json.loads((out / "eval.json").read_text())
    assert {"accuracy", "sft_accuracy", "sft_wall_s", "grpo_wall_s"} <= set(result) and result["num_samples"] == 8
    # "before" is the GRPO stage's evaluation of its starting weights (training.eval_on_start): SFT's export, so
    # the same exact matches as the SFT stage's own evaluation on the same held-out rows
    start = json.loads((out / "grpo" / "eval_start.json").read_text())
    sft = json.loads((out / "sft" / "eval.json").read_text())
    assert start["step"] == 0 and (start["num_correct"], start["num_samples"]) == (sft["num_correct"], 8)
    assert result["start_accuracy"] == sft["accuracy"] and result["start_policy_accuracy"] >= sft["accuracy"]
    assert result["policy_accuracy"] >= result["accuracy"]


def test_the_magistral_smoke_twice(tmp_path):
    out = tmp_path / "out"  # its README's laptop command; it saves every 10 steps (here every step)
    items = _tiny(tmp_path, out, **{"training.save": tmp_path / "ckpt", "training.save_interval": 1})
    first, second = _twice(apprun.command(apprun.EXAMPLES / "magistral-2509" / "smoke.yaml", items))
    assert FINISHED not in first.stdout and FINISHED in second.stdout


def test_a_finished_run_says_so_and_a_longer_one_resumes_it(tmp_path):
    out = tmp_path / "out"
    items = _tiny(tmp_path, out, **{"training.save": tmp_path / "ckpt", "training.no_save_optim": "true"})
    first, second = _twice(apprun.command(apprun.TINY, items))
    assert FINISHED not in first.stdout and FINISHED in second.stdout
    assert "step 2 of training.train_iters 2" in second.stdout and apprun.logged_steps(out) == [1, 2]

    longer = {**items, "training.train_iters": 3, "training.no_load_optim": "true"}
    third = apprun.run(apprun.command(apprun.TINY, longer))
    assert "start: resuming from " in third.stdout and "iter_0000002" in third.stdout
    assert apprun.logged_steps(out) == [1, 2, 3]
