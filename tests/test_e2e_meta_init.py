"""Meta-device init through the trainer: built on meta, sharded, materialised and loaded from an HF
directory (`load_format: hf`) or from a converted DCP `release`, the run's per-step losses equal those
of the same weights loaded eagerly with `from_pretrained` (2 processes, fp32)."""

from pathlib import Path

import torch

from mmfsdp.ckpt import hf_to_dcp
from mmfsdp.data import prepare_dataset
from transformers import Mistral3ForConditionalGeneration
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "data.dataset_param.basic_parameters.dataset_dir": tmp / "data",
        "data.dataset_param.basic_parameters.cache_dir": tmp / "cache",
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "model.model_name_or_path": tmp / "hf",
        "model.random_init": False,
        "training.micro_batch_size": 2,
        "training.train_iters": 3,
        "training.log_interval": 100,
        "training.output_dir": tmp / name,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _three_runs(rank, world_size, tmp):
    from mmfsdp.train.trainer import Trainer

    tmp = Path(tmp)
    runs = {
        "eager": _overrides(tmp, "eager"),
        "meta_hf": _overrides(tmp, "meta_hf", **{
            "training.init_model_with_meta_device": True, "training.load": tmp / "hf", "training.load_format": "hf"}),
        "meta_dcp": _overrides(tmp, "meta_dcp", **{
            "training.init_model_with_meta_device": True, "training.load": tmp / "dcp"}),
    }
    out = {}
    for name, overrides in runs.items():
        trainer = Trainer(load_config(TINY, overrides), "cpu")
        trainer.train()
        out[name] = [r.loss for r in trainer.history]
    return out


def test_meta_init_from_hf_and_from_dcp_match_eager_loading(tmp_path):
    torch.manual_seed(7)
    config = AutoConfig.from_pretrained(ROOT / "examples" / "tiny" / "assets")
    Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    prepare_dataset(load_config(TINY, _overrides(tmp_path, "prep")).data)

    losses = run_distributed(_three_runs, 2, str(tmp_path), timeout=600)[0]
    assert len(losses["eager"]) == 3
    assert losses["meta_hf"] == losses["eager"]
    assert losses["meta_dcp"] == losses["eager"]
