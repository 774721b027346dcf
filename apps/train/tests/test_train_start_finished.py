"""A finished run (`finished_run`): `training.save` holds this run's checkpoint at or past `training.train_iters`.
The app says so and exits 0 before it prepares data or starts a rank, whatever that checkpoint holds (one saved
with `no_save_optim` included); a half-finished run, a checkpoint of `training.load` and a plan that fails are not
finished (the ranks resume or report as before). One process, no model."""

from __future__ import annotations

import logging

import pytest
import torch

from mmfsdp.ckpt import save_checkpoint
from mmfsdp.model import ModelConfig
from mmfsdp.train.cli import main
from mmfsdp.train.config import TrainingConfig
from mmfsdp.train.start import finished_run, plan_start

from apprun import TINY


def _save(save_dir, step: int, stage: str = "sft") -> None:
    """A checkpoint of `step` without optimizer state (as `no_save_optim` saves)."""
    save_checkpoint(save_dir, step, model=torch.nn.Linear(3, 2), metadata={"stage": stage})


@pytest.mark.parametrize("train_iters", [7, 5])
def test_a_checkpoint_at_or_past_train_iters_in_save_is_a_finished_run(tmp_path, train_iters):
    _save(tmp_path / "ckpt", 7)
    line = finished_run(TrainingConfig(save=str(tmp_path / "ckpt"), train_iters=train_iters), ModelConfig())
    assert line.startswith("start: the run is finished: ") and "iter_0000007 is step 7 of training.train_iters" in line
    assert "nothing to train" in line and "Raise training.train_iters" in line and "another training.save" in line


def test_a_half_finished_run_resumes(tmp_path):
    _save(tmp_path / "ckpt", 7)
    training = TrainingConfig(save=str(tmp_path / "ckpt"), train_iters=8)
    assert finished_run(training, ModelConfig()) is None
    assert plan_start(training, ModelConfig()).resume.iteration == 7


def test_a_checkpoint_of_training_load_is_not_this_runs_end(tmp_path):
    _save(tmp_path / "sft", 7)
    training = TrainingConfig(load=str(tmp_path / "sft"), save=str(tmp_path / "new"), train_iters=7)
    assert finished_run(training, ModelConfig()) is None  # continued into a new save: resumed, as the table says
    dpo = TrainingConfig(stage="dpo", load=str(tmp_path / "sft"), save=str(tmp_path / "dpo"), train_iters=7)
    assert finished_run(dpo, ModelConfig()) is None  # another stage's checkpoint: its weights start the run


def test_a_plan_that_fails_is_left_to_the_ranks(tmp_path):
    _save(tmp_path / "sft", 7)  # this save holds another stage's checkpoint: plan_start's error, not "finished"
    assert finished_run(TrainingConfig(stage="dpo", save=str(tmp_path / "sft"), train_iters=7), ModelConfig()) is None
    assert finished_run(TrainingConfig(save=str(tmp_path / "none"), train_iters=7), ModelConfig()) is None


def test_the_app_exits_0_on_a_finished_run(tmp_path, caplog):
    _save(tmp_path / "ckpt", 3)
    items = [f"training.save={tmp_path / 'ckpt'}", "training.train_iters=3", f"training.output_dir={tmp_path / 'out'}",
             f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
             f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mmfsdp.train"):
        assert main([str(TINY), *items, "--nproc-per-node", "2"]) == 0
    assert "start: the run is finished:" in caplog.text
    assert not (tmp_path / "data").exists()  # returned before preparing the data
