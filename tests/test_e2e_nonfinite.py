"""A loss that is NaN/inf stops the run with the step number and the last finite loss."""

from pathlib import Path

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def _overrides(tmp: Path) -> list[str]:
    items = {
        "data.dataset_param.basic_parameters.dataset_dir": tmp / "data",
        "data.dataset_param.basic_parameters.cache_dir": tmp / "cache",
        "data.dataset_param.synthetic.num_train": 16,
        "data.dataset_param.synthetic.num_eval": 4,
        "training.micro_batch_size": 4,
        "training.train_iters": 6,
        "training.lr": 1.0e30,  # one AdamW step moves every weight by ~lr: the next loss overflows
        "training.lr_min": 0.0,
        "training.lr_decay_style": "constant",
        "training.lr_warmup_ratio": 0.0,
        "training.output_dir": tmp / "out",
    }
    return [f"{k}={v}" for k, v in items.items()]


def _train_until_error(rank, world_size, overrides):
    from mmfsdp.train.trainer import Trainer, TrainingError

    trainer = Trainer(load_config(TINY, overrides), "cpu")
    try:
        trainer.train()
    except TrainingError as err:
        return {"message": str(err), "step": trainer.step, "losses": [r.loss for r in trainer.history]}
    return {"message": None, "step": trainer.step, "losses": [r.loss for r in trainer.history]}


def test_non_finite_loss_stops_with_step_and_last_finite_loss(tmp_path):
    overrides = _overrides(tmp_path)
    prepare_dataset(load_config(TINY, overrides).data)
    result = run_distributed(_train_until_error, 1, overrides, timeout=300)[0]
    assert result["message"] is not None, "the run should have stopped"
    failed_at = result["step"] + 1
    assert f"is not finite at step {failed_at}" in result["message"]
    assert f"last finite loss {result['losses'][-1]:.6f} at step {result['step']}" in result["message"]
