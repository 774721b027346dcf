"""`mm-data inspect`: one sample as the model sees it, as text or JSON."""

from __future__ import annotations

import json

import pytest
import yaml

from mmfsdp.data import build_dataset
from mmfsdp.data.cli import TRAIN_CLOSE, TRAIN_OPEN, main


@pytest.fixture()
def config_file(tmp_path, tiny_dir, h):
    h.write_image(tmp_path / "a.png", 32, 16)
    rows = [
        {"messages": [{"role": "user", "content": "<image>What shape and colour is this?"}, {"role": "assistant", "content": "a red circle"}], "images": ["a.png"]},
        {"messages": [{"role": "user", "content": "What shape is this?"}, {"role": "assistant", "content": "a square"}]},
    ]
    h.write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = {
        "parallel": {"ulysses_parallel_size": 4},  # other sections are ignored
        "training": {"lr": 1e-5},
        "data": {
            "dataset_param": {
                "preprocess_parameters": {"model_name_or_path": str(tiny_dir), "template": "mistral", "cutoff_len": 4096},
                "basic_parameters": {"dataset_dir": str(tmp_path), "dataset": "d.jsonl", "cache_dir": str(tmp_path / "cache")},
            },
            "dataloader_param": {"num_workers": 0},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_text_view_marks_the_trained_span(config_file, capsys):
    assert main(["inspect", str(config_file), "data.dataset_param.preprocess_parameters.cutoff_len=128", "--index", "0"]) == 0
    out = capsys.readouterr().out
    assert "tokens: 24 (trained: 4, cutoff_len: 128)" in out  # <s> [INST] 10 image tokens, 7 words, [/INST], 3 words, </s>
    assert "grid 2x4 -> 8 [IMG] + 2 break/end = 10 tokens, processed to 16x32 px" in out
    assert f"[INST]<image 2x4>What shape and colour is this ? [/INST]{TRAIN_OPEN}a red circle </s>{TRAIN_CLOSE}" in out


def test_json_view_is_what_the_model_gets(config_file, tiny_dir, tiny_processor, tmp_path, h, capsys):
    assert main(["inspect", str(config_file), "--index", "-2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    dataset = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": "d.jsonl"}), tiny_processor)
    assert shown["input_ids"] == dataset[0]["input_ids"].tolist() and shown["labels"] == dataset[0]["labels"].tolist()
    assert shown["image_sizes"] == [[16, 32]] and shown["image_grids"] == [[2, 4]] and shown["row"] == 0


def test_errors_and_help(config_file, capsys):
    assert main(["inspect", str(config_file), "--index", "5"]) == 2
    assert "--index: 5 is out of range: the train dataset has 2 samples" in capsys.readouterr().err
    assert main(["inspect", str(config_file), "data.dataset_param.basic_parameters.datset=x"]) == 2
    assert "did you mean 'data.dataset_param.basic_parameters.dataset'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "-h"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(flag in help_text for flag in ("--index", "--split", "--json", "KEY=VALUE", "data: section"))


@pytest.mark.parametrize("position", ["before", "after", "between"])
def test_overrides_may_come_before_after_or_between_options(config_file, capsys, position):
    override = "data.dataset_param.preprocess_parameters.cutoff_len=128"
    argv = {
        "before": ["inspect", str(config_file), override, "--index", "0", "--split", "train"],
        "after": ["inspect", str(config_file), "--index", "0", "--split", "train", override],
        "between": ["inspect", str(config_file), "--index", "0", override, "--split", "train"],
    }[position]
    assert main(argv) == 0
    assert "cutoff_len: 128)" in capsys.readouterr().out  # the override applied (the YAML says 4096)


def test_top_level_help_names_the_command_and_where_its_flags_are(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["-h"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "inspect" in help_text and "mm-data COMMAND -h" in help_text
