"""The tiny Mistral3 run the resume tests restart: 2 processes, accumulation 2, checkpoints every 3 steps.

Imported as `tiny_resume` by test_e2e_resume.py and test_e2e_resume_meta.py.
"""

from __future__ import annotations

from pathlib import Path

import apprun
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

TINY = apprun.TINY
STEPS = 8


def items(data: Path, out: Path) -> dict:
    return {
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


def command(data: Path, out: Path, nproc: int = 2) -> list[str]:
    return apprun.command(TINY, items(data, out), nproc)


def prepared_data(tmp_path_factory) -> Path:
    """A module fixture's body: the tokenized dataset every run of the module reads."""
    tmp = tmp_path_factory.mktemp("resume")
    prepare_dataset(load_config(TINY, apprun.overrides(items(tmp, tmp / "unused"))).data)
    return tmp
