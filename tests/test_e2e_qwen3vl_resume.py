"""Qwen3-VL through the real app: meta-device init from HF weights, then SIGKILL and restart.

The reference loads a `save_pretrained` tiny Qwen3-VL (several safetensors shards) eagerly with
`from_pretrained` on the CPU and trains 6 steps on 2 processes (gradient accumulation 2, 4 steps
per epoch). The second run builds the same model on the meta device, shards it and fills it from the
same HF directory; it is SIGKILLed (launcher and ranks) after its step-3 checkpoint and restarted
with the same command. The restart must say it resumed at step 3, log only steps 4-6, and every
loss of steps 1-6 must equal the reference bitwise: steps 1-3 prove meta init from HF, steps 4-6
prove the resume (mid-epoch, across the epoch boundary) is exact. The reference is the trainer the app's ranks
run, in-process (`apprun.train_in_process`).
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

CONFIG, ASSETS = apprun.QWEN, apprun.QWEN_ASSETS
STEPS = 6
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _items(tmp: Path, out: Path, hf: Path, **extra) -> dict:
    return {
        "data.dataset_param.preprocess_parameters.model_name_or_path": ASSETS,
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        **apprun.synthetic_items(tmp),  # 8 samples per step -> 4 steps per epoch
        "model.model_name_or_path": hf,
        "model.random_init": False,
        **apprun.run_items(out, steps=STEPS, accumulation=2, **{"training.lr_warmup_ratio": 0.0}),
        **extra,
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tmp = tmp_path_factory.mktemp("qwen3vl-resume")
    hf = tmp / "hf"
    torch.manual_seed(5)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_pretrained(ASSETS)).save_pretrained(hf, max_shard_size="300KB")
    assert len(list(hf.glob("*.safetensors"))) > 1
    prepare_dataset(load_config(CONFIG, apprun.overrides(_items(tmp, tmp / "prepare", hf))).data)
    return tmp, hf


def test_qwen3vl_meta_init_from_hf_then_kill_and_restart_is_exact(setup, tmp_path):
    tmp, hf = setup
    reference = apprun.first_losses(apprun.train_in_process(CONFIG, _items(tmp, tmp_path / "eager", hf)))
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "meta"
    cmd = apprun.command(CONFIG, _items(tmp, out, hf, **{
        "training.init_model_with_meta_device": True,
        "training.save_interval": 3,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
    }))
    apprun.kill_and_restart(cmd, out, 3, STEPS)
    for step, values in apprun.losses(out).items():
        assert all(v == reference[step] for v in values), f"step {step}: {values} vs eager HF load {reference[step]}"
    assert read_tracker(out / "ckpt") == STEPS
