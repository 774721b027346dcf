"""GRPO kill-and-resume through the real app: a 2-process qwen3vl-tiny GRPO run SIGKILLed after its step-2
checkpoint and restarted with the same command continues bitwise — per-step loss, gradient norm, tokens and every
logged GRPO statistic (rewards, lengths, entropy, clip ratios, `rollout/logprob_diff_max`) equal the uninterrupted
run's. The completions of a step are keyed by (seed, step, prompt index, generation), so the restart generates
exactly what the uninterrupted run generated after the checkpoint."""

import json
from pathlib import Path

import pytest

import apprun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 4
STATS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/shared_letters/mean",
         "entropy", "clip_ratio/region_mean", "rollout/logprob_diff_max")


def _items(data: Path, out: Path) -> dict:
    return {
        **apprun.synthetic_items(data, num_train=32, num_eval=4),
        **apprun.run_items(out, steps=STEPS, micro_batch_size=1, accumulation=2),
        "training.stage": "grpo",
        "training.lr": 1.0e-2,
        "training.grpo.num_generations": 4,
        "training.grpo.max_completion_length": 6,
        "training.grpo.reward_funcs": f"[accuracy, '{apprun.ROOT / 'tests' / 'grpo_rewards.py'}:shared_letters']",
        "training.save_interval": 2,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
    }


def _rows(out: Path) -> dict[int, tuple]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = (r["loss"], r["grad_norm"], r["num_tokens"], *(r[key] for key in STATS))
    return rows


def test_grpo_kill_and_restart_continues_bitwise(tmp_path):
    reference_out = tmp_path / "reference"
    apprun.run(apprun.command(apprun.QWEN, _items(tmp_path, reference_out)))
    reference = _rows(reference_out)
    assert sorted(reference) == list(range(1, STEPS + 1))
    out = tmp_path / "killed"
    restart, _ = apprun.kill_and_restart(apprun.command(apprun.QWEN, _items(tmp_path, out)), out, 2, STEPS)
    first = next(line for line in restart.stdout.splitlines() if f"/{STEPS} |" in line)
    assert f"step 3/{STEPS}" in first, f"the restart's first logged step is not 3: {first}"
    rows = _rows(out)
    for step in range(1, STEPS + 1):
        assert rows[step] == reference[step], f"step {step}: {rows[step]} vs the uninterrupted run's {reference[step]}"
