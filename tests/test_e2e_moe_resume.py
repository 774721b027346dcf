"""Expert parallel through the real app: SIGKILL after a checkpoint, restart with the same command.

`examples/qwen3vl-moe-tiny/config.yaml` as written (2 processes, `expert_parallel_size: 2`, router aux loss
on), shortened to 6 steps with gradient accumulation 2 (4 steps per epoch). The reference runs the 6 steps
uninterrupted (the trainer the app's ranks run, in-process: `apprun.train_in_process`). The second run saves every 3 steps and is SIGKILLed (launcher and ranks) as soon as its step-3
checkpoint is published, then restarted with the same command: it must say it resumed at step 3, log only
steps 4-6, and every logged LM loss, router aux loss and expert load of steps 1-6 must equal the reference
bitwise (steps 4-6 cross the epoch boundary, so the data position and RNG come back too). Resharding an EP-2
checkpoint to EP 1 is `tests/test_e2e_moe_router.py`.
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

CONFIG = apprun.MOE
STEPS = 6
KEYS = ("loss", "aux_loss", "expert_load_max", "expert_load_mean", "grad_norm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _items(tmp: Path, out: Path, **extra) -> dict:
    return {
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        **apprun.synthetic_items(tmp),  # 8 samples per step -> 4 steps per epoch
        **apprun.run_items(out, steps=STEPS, accumulation=2, **{"training.lr_warmup_ratio": 0.0}),
        **extra,
    }


def test_expert_parallel_kill_and_restart_is_exact(tmp_path):
    cfg = load_config(CONFIG, apprun.overrides(_items(tmp_path, tmp_path / "prepare")))
    assert cfg.parallel.expert_parallel_size == 2 and cfg.features.loss_cfg.router_aux_loss_coef > 0
    prepare_dataset(cfg.data)

    reference_out = apprun.train_in_process(CONFIG, _items(tmp_path, tmp_path / "reference"))
    reference = {r["step"]: tuple(r[k] for k in KEYS) for r in apprun.records(reference_out)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    cmd = apprun.command(CONFIG, _items(tmp_path, out, **{
        "training.save_interval": 3,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
    }))
    apprun.kill_and_restart(cmd, out, 3, STEPS)
    for record in apprun.records(out):
        got = tuple(record[k] for k in KEYS)
        assert got == reference[record["step"]], f"step {record['step']}: {dict(zip(KEYS, got))} vs {reference[record['step']]}"
    assert read_tracker(out / "ckpt") == STEPS
