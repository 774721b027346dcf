"""`plan_start` across stages: a DPO run whose `training.load` is an SFT run's checkpoint starts at step 1 from its
model weights (the checkpoint's `metadata.stage`; none means sft), never resumes it; a checkpoint of another stage
in the run's own `training.save` is an error; the same stage resumes as before (one process, no model)."""

from __future__ import annotations

import pytest
import torch

from mmfsdp.ckpt import save_checkpoint
from mmfsdp.config import ConfigError
from mmfsdp.model import LoraConfig, ModelConfig
from mmfsdp.train.config import TrainingConfig
from mmfsdp.train.start import plan_start


def _save(save_dir, stage: str | None, *, adapter_only: bool = False) -> None:
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(not adapter_only)
    metadata = None if stage is None else {"stage": stage}
    save_checkpoint(save_dir, 7, model=model, trainable_only=adapter_only, metadata=metadata)


@pytest.mark.parametrize("stage", [None, "sft"])
def test_dpo_starts_from_an_sft_checkpoints_weights(tmp_path, stage):
    _save(tmp_path / "sft", stage)
    plan = plan_start(TrainingConfig(stage="dpo", load=str(tmp_path / "sft"), save=str(tmp_path / "dpo")), ModelConfig())
    assert plan.weights == "release" and plan.resume is None and plan.source.endswith("iter_0000007")
    assert "starts at step 1 from the model weights of the sft checkpoint of step 7" in plan.describe()
    # the same stage resumes it
    plan = plan_start(TrainingConfig(load=str(tmp_path / "sft"), save=str(tmp_path / "sft2")), ModelConfig())
    assert plan.weights == "checkpoint" and plan.resume.iteration == 7


def test_a_dpo_run_resumes_its_own_checkpoint(tmp_path):
    _save(tmp_path / "dpo", "dpo")
    plan = plan_start(TrainingConfig(stage="dpo", save=str(tmp_path / "dpo")), ModelConfig())
    assert plan.weights == "checkpoint" and plan.resume.iteration == 7


def test_another_stages_checkpoint_in_save_is_an_error(tmp_path):
    _save(tmp_path / "sft", "sft")
    with pytest.raises(ConfigError) as err:
        plan_start(TrainingConfig(stage="dpo", save=str(tmp_path / "sft")), ModelConfig())
    assert err.value.key == "training.save" and "own training.save" in err.value.message


def test_adapters_of_another_stage_say_how_to_start_from_them(tmp_path):
    _save(tmp_path / "sft", "sft", adapter_only=True)
    lora = LoraConfig(enable=True, target_modules=["q_proj"])
    with pytest.raises(ConfigError) as err:
        plan_start(TrainingConfig(stage="dpo", load=str(tmp_path / "sft"), save=str(tmp_path / "dpo"), lora=lora),
                   ModelConfig())
    assert err.value.key == "training.load" and "pretrained_lora_path" in err.value.message
