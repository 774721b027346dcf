"""`plan_start` with LoRA: an adapter-only checkpoint resumes on the frozen base of the initial weights, and
mixing LoRA and whole-model checkpoints is one error naming `training.lora.enable` (one process, no model)."""

from __future__ import annotations

import pytest
import torch

from mmfsdp.ckpt import save_checkpoint
from mmfsdp.config import ConfigError
from mmfsdp.model import LoraConfig, ModelConfig
from mmfsdp.train.config import TrainingConfig
from mmfsdp.train.start import plan_start

LORA = LoraConfig(enable=True, target_modules=["q_proj"])


def _save(save_dir, *, adapter_only: bool) -> None:
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(not adapter_only)  # a frozen "base" next to a trained "adapter"
    save_checkpoint(save_dir, 3, model=model, trainable_only=adapter_only)


def test_adapter_only_resume_takes_the_base_from_the_initial_weights(tmp_path):
    _save(tmp_path / "ckpt", adapter_only=True)
    plan = plan_start(TrainingConfig(save=str(tmp_path / "ckpt"), lora=LORA), ModelConfig(model_name_or_path="hf"))
    assert (plan.weights, plan.source, plan.resume.iteration) == ("pretrained", "hf", 3)
    assert "on the frozen base from HF weights from model.model_name_or_path hf" in plan.describe()

    load = TrainingConfig(save=str(tmp_path / "ckpt"), load=str(tmp_path / "base"), load_format="hf", lora=LORA)
    assert plan_start(load, ModelConfig()).weights == "hf"

    fresh = TrainingConfig(load=str(tmp_path / "ckpt"), save=str(tmp_path / "new"), lora=LORA)
    plan = plan_start(fresh, ModelConfig(random_init=True))
    assert (plan.weights, plan.resume.iteration) == ("random", 3)


@pytest.mark.parametrize("adapter_only, lora", [(True, LoraConfig()), (False, LORA)])
def test_lora_and_whole_model_checkpoints_do_not_mix(tmp_path, adapter_only, lora):
    _save(tmp_path / "ckpt", adapter_only=adapter_only)
    with pytest.raises(ConfigError) as err:
        plan_start(TrainingConfig(save=str(tmp_path / "ckpt"), lora=lora), ModelConfig(model_name_or_path="hf"))
    assert err.value.key == "training.lora.enable"
    assert ("holds only LoRA adapters" if adapter_only else "holds a whole model") in err.value.message
