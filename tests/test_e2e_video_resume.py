"""Kill-and-resume on video data through the real app: `examples/qwen3vl-video-tiny/config.yaml` on 2 processes.

The data is the example's own mix (`make_motion_dataset`, 32 training rows: clips, images and text-only rows), 8
samples per step (micro-batch 2, accumulation 2), so an epoch is 4 steps. The run is SIGKILLed (launcher and
ranks) after its step-3 checkpoint and restarted with the same command: the restart must say it resumed at step 3,
not start at step 1, log steps 4-6 once, and every loss of steps 1-6 must equal the uninterrupted run's bitwise
(mid-epoch, and across the epoch boundary where the shuffled order of video rows changes). The uninterrupted run
is the trainer the app's ranks run, in-process (`apprun.train_in_process`).
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data.synthetic import make_motion_dataset

CONFIG = apprun.EXAMPLES / "qwen3vl-video-tiny" / "config.yaml"
STEPS = 6
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _items(data: Path, out: Path, **extra) -> dict:
    return {
        "data.dataset_param.basic_parameters.dataset": data / "train.jsonl",
        "data.dataset_param.basic_parameters.eval_dataset": "null",
        "data.dataset_param.basic_parameters.dataset_dir": data,
        "data.dataset_param.basic_parameters.cache_dir": data.parent / "cache",
        **apprun.run_items(out, steps=STEPS, accumulation=2, **{"training.lr_warmup_ratio": 0.0}),
        **extra,
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    data = tmp_path_factory.mktemp("video-resume") / "data"
    meta = make_motion_dataset(data, num_train=32, num_eval=4, seed=3, image_share=0.25, text_only_share=0.25)
    assert meta["num_train"] == 32
    return data


def test_video_run_killed_and_restarted_is_exact(data, tmp_path):
    reference = apprun.first_losses(apprun.train_in_process(CONFIG, _items(data, tmp_path / "reference")))
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    ckpt = {"training.save_interval": 3, "training.save": out / "ckpt", "training.load": out / "ckpt"}
    restart, before = apprun.kill_and_restart(apprun.command(CONFIG, _items(data, out, **ckpt)), out, 3, STEPS)
    resumed = [line for line in restart.stdout.splitlines() if "step 4/" in line or "step 1/" in line]
    assert resumed and "step 4/" in resumed[0], f"the restart's first step is not 4: {resumed[:2]}"
    for step, values in apprun.losses(out).items():
        assert all(v == reference[step] for v in values), f"step {step}: {values} vs uninterrupted {reference[step]}"
    assert read_tracker(out / "ckpt") == STEPS
