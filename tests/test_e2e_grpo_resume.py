"""GRPO kill-and-resume through the real app: a 2-process qwen3vl-tiny GRPO run SIGKILLed after a checkpoint and
restarted with the same command continues bitwise — per-step loss, gradient norm, tokens and every logged GRPO
statistic (rewards, lengths, entropy, clip ratios, `rollout/logprob_diff_max`) equal the uninterrupted run's.

- `num_iterations: 1`, killed after its step-2 checkpoint: the completions of a step are keyed by (seed, step,
  prompt index, generation), so the restart generates exactly what the uninterrupted run generated after it.
- `num_iterations: 2`, killed after its step-3 checkpoint, taken inside a generation batch (generated at step 3,
  trained again at step 4): each rank's checkpoint holds the batch and the first iteration's log-probabilities
  (`GRPOObjective.state_dict`), so the restart's step 4 trains on the same batch with the same old policy, and its
  step 5 generates the next batch from the loader position after the step-3 prompts.
- DAPO's dynamic sampling, with a reward whose text-only groups never vary, so steps resample: the extra rounds'
  prompts come from the run's loader, whose checkpointed position counts them, so the restart draws the prompts the
  uninterrupted run drew (a resampling step before the kill is checked); with `num_iterations: 1` killed after step
  2, and with `num_iterations: 2` killed inside the batch generated at step 3 (its kept groups, micro-batch layout
  and fillers restored from the checkpoint); that run also balances its steps (`data.dataloader_param.balance`:
  each rank's checkpoint holds the completions it trains, generated on either rank, and where they are).
"""

import json
from pathlib import Path

import pytest

import apprun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STATS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/shared_letters/mean",
         "entropy", "clip_ratio/region_mean", "rollout/logprob_diff_max")
DYNAMIC_STATS = (*(key.replace("shared_letters", "image_letters") for key in STATS), "rollout/gen_rounds",
                 "rollout/groups_kept", "rollout/groups_dropped")
DYNAMIC = {
    "training.grpo.dynamic_sampling": "true",
    "training.grpo.reward_funcs": f"[accuracy, '{apprun.ROOT / 'tests' / 'grpo_rewards.py'}:image_letters']",
}
RUNS = {  # name: (num_iterations, steps, the checkpoint the run is killed after, more overrides)
    "one_iteration": (1, 4, 2, {}),
    "two_iterations": (2, 5, 3, {}),
    "dynamic_sampling": (1, 4, 2, DYNAMIC),
    "dynamic_sampling_two_iterations_balanced": (2, 5, 3, {**DYNAMIC, "data.dataloader_param.balance": "true"}),
}


def _items(data: Path, out: Path, num_iterations: int, steps: int, save_interval: int, extra: dict) -> dict:
    return {
        **apprun.synthetic_items(data, num_train=32, num_eval=4),
        **apprun.run_items(out, steps=steps, micro_batch_size=1, accumulation=2),
        "training.stage": "grpo",
        "training.lr": 1.0e-2,
        "training.grpo.num_generations": 4,
        "training.grpo.max_completion_length": 6,
        "training.grpo.num_iterations": num_iterations,
        "training.grpo.reward_funcs": f"[accuracy, '{apprun.ROOT / 'tests' / 'grpo_rewards.py'}:shared_letters']",
        "training.save_interval": save_interval,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
        **extra,
    }


def _rows(out: Path, dynamic: bool) -> dict[int, tuple]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        stats = DYNAMIC_STATS if dynamic else STATS
        rows[r["step"]] = (r["loss"], r["grad_norm"], r["num_tokens"], *(r[key] for key in stats))
    return rows


@pytest.mark.parametrize("run", list(RUNS))
def test_grpo_kill_and_restart_continues_bitwise(tmp_path, run):
    num_iterations, steps, kill_at, extra = RUNS[run]
    reference_out = tmp_path / "reference"
    apprun.run(apprun.command(apprun.QWEN, _items(tmp_path, reference_out, num_iterations, steps, kill_at, extra)))
    reference = _rows(reference_out, bool(extra))
    assert sorted(reference) == list(range(1, steps + 1))
    if extra:  # a step before the kill drew more prompts than the trainer's: the checkpoint's position counts them
        assert any(reference[step][-3] > 1 for step in range(1, kill_at + 1)), reference
    out = tmp_path / "killed"
    restart, _ = apprun.kill_and_restart(
        apprun.command(apprun.QWEN, _items(tmp_path, out, num_iterations, steps, kill_at, extra)), out, kill_at, steps)
    first = next(line for line in restart.stdout.splitlines() if f"/{steps} |" in line)
    assert f"step {kill_at + 1}/{steps}" in first, f"the restart's first logged step is not {kill_at + 1}: {first}"
    assert "generates a new batch" not in restart.stdout + restart.stderr, "the restart did not restore its batch"
    rows = _rows(out, bool(extra))
    for step in range(1, steps + 1):
        assert rows[step] == reference[step], f"step {step}: {rows[step]} vs the uninterrupted run's {reference[step]}"
    if num_iterations > 1:  # a reused batch: the same rewards, trained on again by moved weights
        assert reference[kill_at + 1][3:7] == reference[kill_at][3:7]
        assert reference[kill_at + 2][3:7] != reference[kill_at][3:7]
