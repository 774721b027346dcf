"""The token budget and balance keys: their checks and the other schemas' names for them."""

from pathlib import Path

import pytest

from mmfsdp.config import ConfigError
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def _with_training_key(tmp_path, line):
    path = tmp_path / "veomni.yaml"
    path.write_text(TINY.read_text().replace("training:\n", f"training:\n  {line}\n", 1))
    return path


def test_budget_and_balance_load_and_veomni_names_translate(tmp_path):
    cfg = load_config(TINY, ["training.micro_batch_tokens=4096", "data.dataloader_param.balance=true"])
    assert cfg.training.micro_batch_tokens == 4096 and cfg.data.dataloader_param.balance
    assert load_config(TINY).training.micro_batch_tokens is None
    cfg = load_config(TINY, ["model.encoder_data_balance=true", "training.micro_batch_tokens=512"])
    assert cfg.data.dataloader_param.balance and cfg.training.micro_batch_tokens == 512
    assert load_config(_with_training_key(tmp_path, "dyn_bsz: false")).training.micro_batch_tokens is None


def test_impossible_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^training\.dyn_bsz: True is not supported: .*training\.micro_batch_tokens"):
        load_config(_with_training_key(tmp_path, "dyn_bsz: true"))
    with pytest.raises(ConfigError, match=r"^training\.micro_batch_tokens: must be >= 1"):
        load_config(TINY, ["training.micro_batch_tokens=0"])
    with pytest.raises(ConfigError, match=r"dataloader_param\.balance: with packing, balance needs training\.micro"):
        load_config(TINY, ["data.dataloader_param.balance=true", "data.dataset_param.basic_parameters.packing=true"])
    with pytest.raises(ConfigError, match=r"^data\.dataloader_param\.cost_model: .* is not a file"):
        load_config(TINY, [f"data.dataloader_param.cost_model={tmp_path / 'missing.json'}"])
