"""examples/qwen3vl-dpo-tiny: both stages' configs pass `--check`, and its answer counter (no training; its driver:
test_train_two_stage_examples.py)."""

import importlib.util
from pathlib import Path

import pytest

from mmfsdp.train.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "qwen3vl-dpo-tiny"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"dpo_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hf_export(path: Path) -> Path:
    """A random-init save of the example's model: what the DPO stage loads from the SFT stage."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    Qwen3VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(ASSETS)).save_pretrained(path)
    return path


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_the_stages_pass_check(capsys, tmp_path, stage):
    load = [f"training.load={_hf_export(tmp_path / 'sft_hf')}"] if stage == "dpo" else []
    cache = f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}"
    code = main([str(EXAMPLE / f"{stage}.yaml"), "--check", f"training.output_dir={tmp_path / 'out'}",
                 f"training.save={tmp_path / 'ckpt'}", cache, *load, "--nproc-per-node", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and "check passed: 2 processes" in captured.out, captured.err[-2000:]


@pytest.mark.parametrize(
    ("answer", "kind"),
    [("a red circle", "correct"), ("a blue circle", "colour"), ("a red square", "shape"),
     ("a green triangle", "both"), ("red circle", "other"), ("a red circle circle", "other")],
)  # fmt: skip
def test_answers_names_the_wrong_part(answer, kind):
    assert _module("answers").classify(answer, "a red circle") == kind
