"""Exact resume through the real app: a 2-process run SIGKILLed mid-run and restarted with the same
command continues with per-step losses bitwise identical to the uninterrupted run (fp32, CPU),
mid-epoch and with gradient accumulation. Also: an interrupted run leaves the tracker on a complete
checkpoint, and a changed world size resumes model and optimizer.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
APP = ROOT / "apps" / "train"
STEPS = 8


def _overrides(data: Path, out: Path) -> list[str]:
    items = {
        "data.dataset_param.basic_parameters.dataset_dir": data / "data",
        "data.dataset_param.basic_parameters.cache_dir": data / "cache",
        "data.dataset_param.synthetic.num_train": 32,  # 8 samples per step -> 4 steps per epoch
        "data.dataset_param.synthetic.num_eval": 4,
        "training.micro_batch_size": 2,
        "training.gradient_accumulation_steps": 2,
        "training.train_iters": STEPS,
        "training.log_interval": 1,
        "training.save_interval": 3,  # checkpoints at steps 3 and 6: both mid-epoch
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
        "training.output_dir": out,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _command(data, out, nproc=2):
    return [sys.executable, str(APP), str(TINY), *_overrides(data, out), "--nproc-per-node", str(nproc)]


_losses = apprun.losses
_kill_tree = apprun.kill_tree
_run = apprun.run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    prepare_dataset(load_config(TINY, _overrides(tmp, tmp / "unused")).data)
    return tmp


def test_sigkill_and_restart_continue_bitwise(data, tmp_path):
    reference_out = tmp_path / "reference"
    _run(_command(data, reference_out))
    reference = _losses(reference_out)
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    proc = subprocess.Popen(_command(data, out), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(l)["step"] >= 5 for l in metrics.read_text().splitlines()):
            break
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.2)
    _kill_tree(proc.pid)
    proc.wait()
    tracker = read_tracker(out / "ckpt")
    assert tracker in (3, 6), f"tracker points at {tracker!r}"
    logged_before = len(metrics.read_text().splitlines())

    restart = _run(_command(data, out))
    assert f"at step {tracker}" in restart.stdout, [l for l in restart.stdout.splitlines() if "step" in l][:5]
    new_steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()[logged_before:]]
    assert new_steps == list(range(tracker + 1, STEPS + 1)), "the restart continues after the last checkpoint"
    resumed = _losses(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, losses in resumed.items():
        assert all(loss == reference[step][0] for loss in losses), f"step {step}: {losses} vs {reference[step]}"


def test_resume_on_a_different_world_size_loads_model_and_optimizer(data, tmp_path):
    out = tmp_path / "reshard"
    cmd = _command(data, out)
    first = [c if c != f"training.train_iters={STEPS}" else "training.train_iters=3" for c in cmd]
    _run(first)
    assert read_tracker(out / "ckpt") == 3
    proc = _run(_command(data, out, nproc=1))
    assert "resumed from" in proc.stdout
    steps = _losses(out)
    assert sorted(steps) == list(range(1, STEPS + 1))


# ---------------------------------------------------------------- one resume rule under meta-device init

META_STEPS = 12


def _meta_command(data: Path, out: Path, hf: Path, *, load_is_save: bool) -> list[str]:
    """12 steps, checkpoints every 3, accumulation 2, meta-device init from the HF weights in `hf`.

    `load_is_save: False` names the HF directory in `training.load` (load_format: hf);
    True sets `training.load` = `training.save` (no tracker on the first run) and gives the
    initial weights through `model.model_name_or_path`.
    """
    cmd = [c for c in _command(data, out) if not c.startswith(("training.train_iters=", "training.load="))]
    extra = {"training.train_iters": META_STEPS, "training.init_model_with_meta_device": True, "model.random_init": False}
    if load_is_save:
        extra.update({"training.load": out / "ckpt", "model.model_name_or_path": hf})
    else:
        extra.update({"training.load": hf, "training.load_format": "hf"})
    at = cmd.index("--nproc-per-node")
    return cmd[:at] + [f"{k}={v}" for k, v in extra.items()] + cmd[at:]


@pytest.fixture(scope="module")
def hf_weights(tmp_path_factory):
    import torch
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    hf = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(11)
    config = AutoConfig.from_pretrained(ROOT / "examples" / "tiny" / "assets")
    Mistral3ForConditionalGeneration(config).save_pretrained(hf, max_shard_size="300KB")
    return hf


@pytest.fixture(scope="module")
def meta_reference(data, hf_weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta-reference")
    proc = _run(_meta_command(data, out, hf_weights, load_is_save=False))
    assert "no checkpoint to resume; training starts at step 1 from HF weights from training.load" in proc.stdout
    losses = _losses(out)
    assert sorted(losses) == list(range(1, META_STEPS + 1))
    return {step: values[0] for step, values in losses.items()}


def _kill_after_checkpoint(cmd: list[str], out: Path, iteration: int) -> None:
    apprun.kill_after_checkpoint(cmd, out / "ckpt", iteration)


@pytest.mark.slow
@pytest.mark.parametrize("load_is_save", [False, True], ids=["load_hf_dir", "load_equals_save"])
def test_meta_init_kill_and_restart_resumes_bitwise(data, hf_weights, meta_reference, tmp_path, load_is_save):
    """The same command restarted after SIGKILL resumes from the step-6 checkpoint (not the HF weights,
    not step 1) and every logged loss of steps 1-12 equals the uninterrupted run's bitwise."""
    out = tmp_path / "killed"
    cmd = _meta_command(data, out, hf_weights, load_is_save=load_is_save)
    _kill_after_checkpoint(cmd, out, 6)
    before = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert before[:6] == list(range(1, 7)) and max(before) < 9, before

    restart = _run(cmd)
    assert "start: resuming from" in restart.stdout and "iter_0000006 (step 6" in restart.stdout, restart.stdout[-2000:]
    assert "resumed from" in restart.stdout and "at step 6" in restart.stdout
    assert "training starts at step 1" not in restart.stdout
    after = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()][len(before):]
    assert after == list(range(7, META_STEPS + 1)), "the restart continues after the step-6 checkpoint"
    for step, losses in _losses(out).items():
        assert all(loss == meta_reference[step] for loss in losses), f"step {step}: {losses} vs {meta_reference[step]}"
    assert read_tracker(out / "ckpt") == META_STEPS
