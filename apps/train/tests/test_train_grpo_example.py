"""examples/qwen3vl-grpo-tiny: both stages' configs pass `--check` (its driver: test_train_two_stage_examples.py)."""

from pathlib import Path

import pytest

from mmfsdp.train.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "qwen3vl-grpo-tiny"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"


def _hf_export(path: Path) -> Path:
    """A random-init save of the example's model: what the GRPO stage loads from the SFT stage."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    Qwen3VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(ASSETS)).save_pretrained(path)
    return path


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_the_stages_pass_check(capsys, tmp_path, stage):
    load = [f"training.load={_hf_export(tmp_path / 'sft_hf')}"] if stage == "grpo" else []
    cache = f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}"
    code = main([str(EXAMPLE / f"{stage}.yaml"), "--check", f"training.output_dir={tmp_path / 'out'}",
                 f"training.save={tmp_path / 'ckpt'}", cache, *load, "--nproc-per-node", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and "check passed: 2 processes" in captured.out, captured.err[-2000:]


def test_policy_accuracy_takes_the_argmax_over_the_tokens_the_engine_samples():
    """eval.json's `policy_accuracy` (`PolicyArgmax`): a row whose whole-vocabulary argmax is a suppressed media
    placeholder counts as the engine decodes it (the next-best token), while `exact_match` (`accuracy`) misses it;
    a row wrong among the kept tokens stays wrong; padding rows' -100 targets are ignored."""
    import torch

    from mmfsdp.train.evaluate import exact_match
    from mmfsdp.train.grpo_validation import PolicyArgmax

    vocab, placeholder = 6, 5
    targets = torch.tensor([[1, 2, -100], [1, 3, -100], [4, -100, -100]])
    logits = torch.zeros(3, 3, vocab)
    logits[0, 0, 1], logits[0, 1, placeholder], logits[0, 1, 2] = 3.0, 9.0, 2.0  # placeholder first, then right
    logits[1, 0, 1], logits[1, 1, placeholder], logits[1, 1, 0] = 3.0, 9.0, 2.0  # placeholder first, then wrong
    logits[2, 0, 4] = 1.0  # right outright
    metrics = PolicyArgmax((placeholder,))
    sums = metrics.batch({}, {}, logits, targets)
    assert exact_match(logits, targets).tolist() == [False, False, True]
    assert sums.tolist() == [2.0, 3.0]
    assert metrics.result(sums.tolist()) == {"policy_accuracy": 2 / 3}


def test_eval_on_start_needs_evaluation_data(tmp_path):
    """`training.eval_on_start` with a JSON dataset and no eval_dataset: a config error naming the key."""
    from mmfsdp.config import ConfigError
    from mmfsdp.train.config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg_path = EXAMPLE / "sft.yaml"
    with pytest.raises(ConfigError, match="training.eval_on_start"):
        load_config(cfg_path, ["training.eval_on_start=true", "data.dataset_param.dataset_type=huggingface",
                               f"data.dataset_param.basic_parameters.dataset={data}"])
