"""`training.stage: dpo` in the config and the memory plan: keys, foreign names, checks, the reference's memory."""

from pathlib import Path

import pytest

from mmfsdp.config import ConfigError
from mmfsdp.train.config import load_config
from mmfsdp.train.memory import memory_plan

ROOT = Path(__file__).resolve().parents[3]
QWEN = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"


def _cfg(*overrides):
    return load_config(str(QWEN), ["training.stage=dpo", "data.dataset_param.attr.ranking=true", *overrides])


def test_dpo_reads_pairs():
    assert load_config(str(QWEN), ["training.stage=dpo"]).data.dataset_param.attr.ranking is True


def test_llamafactory_top_level_keys(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text(QWEN.read_text() + "\nstage: dpo\npref_beta: 0.3\npref_loss: sigmoid\npref_ftx: 0.1\n")
    cfg = load_config(str(path), ["data.dataset_param.attr.ranking=true"])
    assert (cfg.training.stage, cfg.training.dpo.beta, cfg.training.dpo.rpo_alpha) == ("dpo", 0.3, 0.1)


def test_llamafactory_and_trl_names_load_as_ours():
    cfg = _cfg("training.pref_beta=0.25", "training.pref_loss=ipo", "training.pref_ftx=0.5",
               "training.dpo_label_smoothing=0.1", "training.dpo.precompute_ref_log_probs=true")
    assert (cfg.training.dpo.beta, cfg.training.dpo.loss_type, cfg.training.dpo.rpo_alpha) == (0.25, "ipo", 0.5)
    assert cfg.training.dpo.label_smoothing == 0.1 and cfg.training.dpo.precompute_ref_logps is True


@pytest.mark.parametrize(
    ("override", "key"),
    [("training.dpo.beta=0", "training.dpo.beta"), ("training.dpo.label_smoothing=0.5", "training.dpo.label_smoothing"),
     ("training.dpo.rpo_alpha=-1", "training.dpo.rpo_alpha"), ("training.dpo.loss_type=kto", "training.dpo.loss_type")],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        _cfg(override)
    assert key in str(err.value)


def test_a_trained_adapter_needs_the_precomputed_reference(tmp_path):
    with pytest.raises(ConfigError) as err:
        _cfg("training.lora.enable=true", "training.lora.target_modules=[q_proj]",
             f"training.lora.pretrained_lora_path={tmp_path}")
    assert "training.dpo.precompute_ref_logps" in str(err.value)


def test_memory_plan_counts_pairs_and_the_frozen_reference():
    sft = memory_plan(load_config(str(QWEN), []), 2, 64 * 2**30)
    live = memory_plan(_cfg(), 2, 64 * 2**30)
    pre = memory_plan(_cfg("training.dpo.precompute_ref_logps=true"), 2, 64 * 2**30)
    lora = memory_plan(_cfg("training.lora.enable=true", "training.lora.target_modules=[q_proj]"), 2, 64 * 2**30)
    assert live.reference == sft.parameters > 0  # the frozen copy: the master copy's shards again
    assert pre.reference == 0 and lora.reference == 0
    assert live.activations > sft.activations  # micro_batch_size counts pairs: twice the sequences
    assert live.total == pre.total + live.reference
