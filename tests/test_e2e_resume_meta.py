"""Exact resume under meta-device init, through the real app: a 2-process run that builds on the meta
device and loads HF weights is SIGKILLed after its step-6 checkpoint; the same command restarted resumes
from that checkpoint (not from the HF weights, not at step 1) and every loss of steps 1-12 equals the
uninterrupted run's bitwise. Both ways of naming the weights: `training.load` = the HF directory, and
`training.load` = `training.save` with the weights in `model.model_name_or_path`.

The uninterrupted run is the trainer the app's ranks run, in-process (`apprun.train_in_process`); the app's own
start line for HF weights in `training.load` is read from the killed run's log.

Split from test_e2e_resume.py so the two files run on different test workers.
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from tiny_resume import TINY, items, prepared_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_data(tmp_path_factory)


META_STEPS = 12


def _meta_items(data: Path, out: Path, hf: Path, *, load_is_save: bool) -> dict:
    """12 steps, checkpoints every 3, accumulation 2, meta-device init from the HF weights in `hf`.

    `load_is_save: False` names the HF directory in `training.load` (load_format: hf);
    True sets `training.load` = `training.save` (no tracker on the first run) and gives the
    initial weights through `model.model_name_or_path`.
    """
    extra = {"training.train_iters": META_STEPS, "training.init_model_with_meta_device": True, "model.random_init": False}
    if load_is_save:
        extra.update({"training.load": out / "ckpt", "model.model_name_or_path": hf})
    else:
        extra.update({"training.load": hf, "training.load_format": "hf"})
    return {**items(data, out), **extra}


@pytest.fixture(scope="module")
def hf_weights(tmp_path_factory):
    import torch
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    hf = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(11)
    config = AutoConfig.from_pretrained(apprun.TINY_ASSETS)
    Mistral3ForConditionalGeneration(config).save_pretrained(hf, max_shard_size="300KB")
    return hf


@pytest.fixture(scope="module")
def meta_reference(data, hf_weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta-reference")
    losses = apprun.first_losses(apprun.train_in_process(TINY, _meta_items(data, out, hf_weights, load_is_save=False)))
    assert sorted(losses) == list(range(1, META_STEPS + 1))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("load_is_save", [False, True], ids=["load_hf_dir", "load_equals_save"])
def test_meta_init_kill_and_restart_resumes_bitwise(data, hf_weights, meta_reference, tmp_path, load_is_save):
    """The same command restarted after SIGKILL resumes from the step-6 checkpoint (not the HF weights,
    not step 1) and every logged loss of steps 1-12 equals the uninterrupted run's bitwise."""
    out = tmp_path / "killed"
    cmd = apprun.command(TINY, _meta_items(data, out, hf_weights, load_is_save=load_is_save))
    restart, before = apprun.kill_and_restart(cmd, out, 6, META_STEPS)
    assert max(before) < 9, before
    if not load_is_save:  # the killed run started from the HF weights that training.load names
        killed = apprun.consoles(out)[0]
        assert "no checkpoint to resume; training starts at step 1 from HF weights from training.load" in killed
    assert "start: resuming from" in restart.stdout and "iter_0000006 (step 6" in restart.stdout, restart.stdout[-2000:]
    for step, losses in apprun.losses(out).items():
        assert all(loss == meta_reference[step] for loss in losses), f"step {step}: {losses} vs {meta_reference[step]}"
    assert read_tracker(out / "ckpt") == META_STEPS
