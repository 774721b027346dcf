"""LoRA through the real app: meta-device init from HF weights, adapter-only checkpoints, SIGKILL and restart.

The tiny resume run (`tiny_resume`: 2 processes, gradient accumulation 2, 4 steps per epoch, a checkpoint every
3 steps) with LoRA on the attention projections, built on the meta device and filled from a `save_pretrained`
tiny Mistral3 (`model.model_name_or_path`, `training.load` = `training.save`). The reference runs 6 steps
uninterrupted (the trainer the app's ranks run, in-process: `apprun.train_in_process`); the second run is SIGKILLed (launcher and ranks) after its step-3 checkpoint and restarted with
the same command. The restart must load the base from the HF weights and the adapters, optimizer, scheduler,
data position and RNG from the checkpoint, log only steps 4-6 (across the epoch boundary), and every loss must
equal the reference's bitwise. The checkpoints hold no base weight.
"""

from __future__ import annotations

import json

import pytest

import apprun
import tiny_resume
from mmfsdp.ckpt import read_checkpoint_info, read_tracker

STEPS = 6
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    data = tiny_resume.prepared_data(tmp_path_factory)
    hf = data / "hf"
    torch.manual_seed(11)
    Mistral3ForConditionalGeneration(
        Mistral3Config.from_pretrained(apprun.TINY_ASSETS)
    ).save_pretrained(hf)
    return data, hf


def _items(data, hf, out) -> dict:
    items = {
        **tiny_resume.items(data, out),
        "training.train_iters": STEPS,
        "training.lr": 1.0e-2,
        "model.model_name_or_path": hf,
        "model.random_init": False,
        "training.init_model_with_meta_device": True,
        "training.lora.enable": True,
        "training.lora.rank": 8,
        "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]",
    }
    return items


def test_lora_meta_init_kill_and_restart_resumes_bitwise(setup, tmp_path):
    data, hf = setup
    reference = apprun.first_losses(apprun.train_in_process(apprun.TINY, _items(data, hf, tmp_path / "reference")))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1], "the LoRA run should learn"

    out = tmp_path / "killed"
    cmd = apprun.command(apprun.TINY, _items(data, hf, out))
    restart, _ = apprun.kill_and_restart(cmd, out, 3, STEPS)
    assert "on the frozen base from HF weights from model.model_name_or_path" in restart.stdout, restart.stdout[-2000:]
    for step, values in apprun.losses(out).items():
        assert all(v == reference[step] for v in values), f"step {step}: {values} vs uninterrupted {reference[step]}"

    assert read_tracker(out / "ckpt") == STEPS
    checkpoint = out / "ckpt" / f"iter_{STEPS:07d}"
    info = read_checkpoint_info(checkpoint)
    assert info["trainable_only"] is True and info["metadata"]["lora"]["r"] == 8
    from mmfsdp.ckpt.dcp_io import read_dcp_metadata

    model_keys = [k for k in read_dcp_metadata(checkpoint).state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    json.dumps(info)  # checkpoint.json stays plain JSON
