"""Qwen3-Omni (`qwen3_omni_moe`) through the real app: SIGKILL after a checkpoint, restart with the same command.

`examples/qwen3omni-tiny/config.yaml` (the random-init tiny thinker: audio tower, vision tower, MoE decoder) on its
synthetic beeps data (clip rows, shapes image rows and text-only rows, 32 training rows: with micro-batches of 2,
gradient accumulation 2 and 2 processes, 4 steps per epoch), 6 steps, padding-free micro-batches, expert parallel 2
with the router aux loss on. The reference runs the 6 steps uninterrupted (the trainer the app's ranks run,
in-process: `apprun.train_in_process`). The second run saves every 3 steps and is SIGKILLed (launcher and ranks) as
soon as its step-3 checkpoint is published, then restarted with the same command: it must say it resumed at step 3
(`iter_0000003`), log only steps 4-6 (`apprun.kill_and_restart`), and every logged LM loss, gradient norm, router
aux loss and expert load of steps 1-6 must equal the reference bitwise (steps 4-6 cross the epoch boundary, so the
data position and the RNG come back too).
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

CONFIG, ASSETS = apprun.EXAMPLES / "qwen3omni-tiny" / "config.yaml", apprun.EXAMPLES / "qwen3omni-tiny" / "assets"
STEPS = 6
KEYS = ("loss", "grad_norm", "aux_loss", "expert_load_max", "expert_load_mean")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _items(tmp: Path, out: Path, **extra) -> dict:
    return {
        "model.model_name_or_path": ASSETS,
        "data.dataset_param.preprocess_parameters.model_name_or_path": ASSETS,
        **apprun.synthetic_items(tmp),  # 8 samples per step -> 4 steps per epoch
        "data.dataset_param.synthetic.image_share": 0.25,
        "data.dataset_param.synthetic.text_only_share": 0.25,
        "data.dataloader_param.padding_free": True,
        "parallel.expert_parallel_size": 2,
        "features.loss_cfg.router_aux_loss_coef": 0.5,
        **apprun.run_items(out, steps=STEPS, accumulation=2, **{"training.lr_warmup_ratio": 0.0}),
        **extra,
    }


def test_qwen3omni_kill_and_restart_is_exact(tmp_path):
    cfg = load_config(CONFIG, apprun.overrides(_items(tmp_path, tmp_path / "prepare")))
    assert cfg.model.model_id == "qwen3_omni_moe" and cfg.features.loss_cfg.router_aux_loss_coef > 0
    prepare_dataset(cfg.data)

    reference_out = apprun.train_in_process(CONFIG, _items(tmp_path, tmp_path / "reference"))
    reference = {r["step"]: tuple(r[k] for k in KEYS) for r in apprun.records(reference_out)}
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert all(value is not None for values in reference.values() for value in values), reference

    out = tmp_path / "killed"
    cmd = apprun.command(CONFIG, _items(tmp_path, out, **{
        "training.save_interval": 3,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
    }))
    restart, before = apprun.kill_and_restart(cmd, out, 3, STEPS)
    assert "iter_0000003 (step 3" in restart.stdout, restart.stdout[-2000:]
    apprun.assert_steps_equal(out, reference, KEYS, STEPS)
    assert read_tracker(out / "ckpt") == STEPS
