"""The Magistral-Small-2509 recipes end to end: the smoke run of `examples/magistral-2509/smoke.yaml` through the
real app on 2 CPU processes, cut to its first `STEPS` steps (finite, decreasing losses, the checkpoint of
`save_interval`, then a resume that trains only steps 11..12), and both full-size recipes passing `--check` at
their world sizes against the real
Magistral config.json (written from the published dimensions; meta device, no weights) through the app's `main`
in-process (what `apps/train CONFIG --check` runs: no process starts).
"""

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest

import apprun
from toolrun import run_tool
from mmfsdp.train.cli import main

ROOT = apprun.ROOT
RECIPES = apprun.EXAMPLES / "magistral-2509"

_spec = importlib.util.spec_from_file_location("magistral_config", ROOT / "tests" / "magistral_config.py")
magistral_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(magistral_config)


def _app(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python apps/train ARGS` from the repository root, forked with its imports done (`toolrun`)."""
    return run_tool(apprun.APP, list(args), timeout=timeout)


STEPS = 10
"""The smoke config's first `save_interval` steps: its whole run (30) checks nothing more — the mean loss of the last
5 steps is below the first 5's at 10 steps as at 30, the checkpoint and the resume are the same code — and costs 20
steps and 2 checkpoints more on 2 ranks (the file: 45.9 -> 40.3 CPU-seconds, measured)."""


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smoke_steps_then_resume(tmp_path):
    overrides = [
        f"training.train_iters={STEPS}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
        f"training.save={tmp_path / 'ckpt'}",
        f"training.output_dir={tmp_path / 'out'}",
    ]
    first = _app(str(RECIPES / "smoke.yaml"), *overrides, "--nproc-per-node", "2")
    assert first.returncode == 0, first.stderr[-4000:]
    records = _steps(tmp_path / "out")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    assert (tmp_path / "ckpt" / f"iter_{STEPS:07d}").is_dir()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)

    second = _app(str(RECIPES / "smoke.yaml"), *overrides, f"training.train_iters={STEPS + 2}", "--nproc-per-node", "2")
    assert second.returncode == 0, second.stderr[-4000:]
    log = second.stdout + second.stderr
    assert f"resumed from {tmp_path / 'ckpt' / f'iter_{STEPS:07d}'} at step {STEPS}" in log, log[-4000:]
    resumed = _steps(tmp_path / "out")[len(records):]
    assert [r["step"] for r in resumed] == [STEPS + 1, STEPS + 2]
    assert all(math.isfinite(r["loss"]) for r in resumed)


@pytest.mark.parametrize(("recipe", "nproc"), [("config_8card.yaml", 8), ("config_4card.yaml", 4), ("config_lora.yaml", 4)])
def test_recipes_pass_check_with_the_real_config(tmp_path, capsys, recipe, nproc):
    model_dir = magistral_config.write_magistral_config(tmp_path / "Magistral-Small-2509")
    dataset = tmp_path / "mllm.json"
    dataset.write_text("[]\n")
    code = main([
        str(RECIPES / recipe),
        f"model.model_name_or_path={model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}",
        f"data.dataset_param.basic_parameters.dataset={dataset}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp_path}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
        # no weights here: --check builds on meta for its checks, and the run it checks would random-init;
        # the host has no accelerator, so sdpa stands in for flash_attention_2
        "model.random_init=true",
        "training.load=null",
        "training.init_model_with_meta_device=false",
        "model.attn_implementation=sdpa",
        f"training.save={tmp_path / 'save'}",
        f"training.output_dir={tmp_path / 'out'}",
        "--check", "--nproc-per-node", str(nproc),
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    assert f"check passed: {nproc} processes" in captured.out, captured.out[-3000:]
