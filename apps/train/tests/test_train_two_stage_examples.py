"""examples/two_stage.py, the driver of the DPO and GRPO examples' run.py: the two stages' app arguments chain SFT's
HF export into the second stage, with shared and per-stage overrides (no training; the examples run twice in
tests/test_e2e_examples_rerun.py)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

import two_stage  # noqa: E402


@pytest.mark.parametrize(("example", "second", "sft_iters"), [("qwen3vl-dpo-tiny", "dpo", 200),
                                                              ("qwen3vl-grpo-tiny", "grpo", 300)])
def test_the_stages_chain_through_the_sft_export(tmp_path, example, second, sft_iters):
    folder = ROOT / "examples" / example
    out, rest = two_stage.split_overrides(["training.seed=2", f"training.output_dir={tmp_path}",
                                           "training.train_iters=7"], f"outputs/{example}")
    assert out == tmp_path and rest == ["training.seed=2", "training.train_iters=7"]
    (sft_name, sft), (name, other) = two_stage.stage_commands(folder, second, out, rest)
    assert (sft_name, name) == ("sft", second)
    assert sft[0] == str(folder / "sft.yaml") and other[0] == str(folder / f"{second}.yaml")
    assert sft[-2:] == [f"training.output_dir={tmp_path / 'sft'}", f"training.save={tmp_path}/sft/ckpt"]
    assert other[-3:] == [f"training.output_dir={tmp_path / second}", f"training.save={tmp_path}/{second}/ckpt",
                          f"training.load={tmp_path / 'sft' / 'ckpt' / 'hf' / 'iter_0000007'}"]  # fmt: skip
    assert "training.seed=2" in sft and "training.seed=2" in other

    # sft.yaml's own length names the export when no override changes it
    _, (_, other) = two_stage.stage_commands(folder, second, out, [])
    assert other[-1].endswith(f"iter_{sft_iters:07d}")
    (_, sft), (_, other) = two_stage.stage_commands(
        folder, second, out, ["sft:training.train_iters=5", f"{second}:training.seed=3", "training.lr=1"])
    assert "training.train_iters=5" in sft and "training.train_iters=5" not in other
    assert other[-1].endswith("iter_0000005")
    assert "training.seed=3" in other and "training.seed=3" not in sft
    assert "training.lr=1" in sft and "training.lr=1" in other


def test_a_relative_output_root_is_under_the_repository_and_a_bare_word_is_refused():
    out, _ = two_stage.split_overrides([], "outputs/x")
    assert out == ROOT / "outputs" / "x"
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        two_stage.split_overrides(["training.seed"], "outputs/x")
