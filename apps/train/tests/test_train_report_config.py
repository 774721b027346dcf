"""`tools.report_to` and the metrics-sink keys: one line turns a sink on, off by default; the names LLaMA-Factory
(HF TrainingArguments) and Megatron / MindSpeed write are accepted."""

import pytest
import yaml

from mmfsdp.config import ConfigError, to_dict
from mmfsdp.train.config import Config, load_config


def _load(tmp_path, data, overrides=None):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, overrides)


@pytest.mark.parametrize(
    "value, sinks",
    [
        (None, []),
        ("none", []),
        ("tensorboard", ["tensorboard"]),
        ("wandb", ["wandb"]),
        ("all", ["tensorboard", "wandb"]),
        ("wandb,tensorboard", ["tensorboard", "wandb"]),
        (["wandb", "tensorboard", "wandb"], ["tensorboard", "wandb"]),
        ([], []),
    ],
)
def test_train_report_to_values(tmp_path, value, sinks):
    data = {} if value is None else {"tools": {"report_to": value}}
    assert _load(tmp_path, data).tools.report_to == sinks


def test_train_report_to_one_override_line(tmp_path):
    cfg = _load(tmp_path, {}, ["tools.report_to=tensorboard"])
    assert cfg.tools.report_to == ["tensorboard"] and cfg.tools.tensorboard_dir is None


def test_train_report_to_unknown_sink_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, {"tools": {"report_to": ["tensorboard", "swanlab"]}})
    assert "tools.report_to" in str(err.value) and "'swanlab'" in str(err.value)


def test_train_report_foreign_keys(tmp_path):
    # a LLaMA-Factory file's top-level keys
    cfg = _load(tmp_path, {"report_to": "wandb", "run_name": "sft-1", "logging_dir": "tb"})
    assert (cfg.tools.report_to, cfg.tools.run_name, cfg.tools.tensorboard_dir) == (["wandb"], "sft-1", "tb")
    # the same under training:, and Megatron's names
    cfg = _load(tmp_path, {"training": {"report_to": ["tensorboard"], "tensorboard_dir": "tb2",
                                        "wandb_project": "p", "wandb_exp_name": "e", "wandb_save_dir": "w"}})
    t = cfg.tools
    assert (t.report_to, t.tensorboard_dir, t.wandb_project, t.run_name, t.wandb_dir) == (
        ["tensorboard"], "tb2", "p", "e", "w")
    cfg = _load(tmp_path, {"tools": {"logging_dir": "tb3"}})
    assert cfg.tools.tensorboard_dir == "tb3"


def test_train_peak_tflops_must_be_positive(tmp_path):
    assert _load(tmp_path, {"tools": {"peak_tflops": 312}}).tools.peak_tflops == 312.0
    with pytest.raises(ConfigError, match="tools.peak_tflops"):
        _load(tmp_path, {"tools": {"peak_tflops": 0}})


def test_train_report_to_round_trips_resolved(tmp_path):
    cfg = _load(tmp_path, {"report_to": "all"})
    assert to_dict(cfg)["tools"]["report_to"] == ["tensorboard", "wandb"]
    assert to_dict(Config())["tools"]["report_to"] == []
