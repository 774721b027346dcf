"""`apps/train --check`: every problem one line naming its key, all at once, exit 2, no traceback."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmfsdp.train.cli import main
from mmfsdp.train.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "tiny" / "assets"


def _check(capsys, tmp_path, *overrides):
    code = main([str(TINY), "--check", f"training.output_dir={tmp_path / 'out'}", *overrides, "--nproc-per-node", "2"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("config error: ")]
    return code, lines, captured


def _only(capsys, tmp_path, key, *overrides):
    code, lines, captured = _check(capsys, tmp_path, *overrides)
    assert code == 2 and "Traceback" not in captured.err
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}: "), captured.err
    return lines[0]


def test_tiny_config_passes(capsys, tmp_path):
    code, lines, captured = _check(capsys, tmp_path)
    assert code == 0 and not lines
    assert "check passed: 2 processes" in captured.out


def test_model_dir_without_safetensors(capsys, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(ASSETS / "config.json", model_dir / "config.json")
    line = _only(capsys, tmp_path, "model.model_name_or_path", f"model.model_name_or_path={model_dir}", "model.random_init=false")
    assert "no safetensors" in line


def test_freeze_pattern_matching_nothing(capsys, tmp_path):
    line = _only(capsys, tmp_path, r"model.freeze[0]", "model.freeze=[model.visual]")
    assert "model.vision_tower" in line


def test_freeze_everything(capsys, tmp_path):
    _only(capsys, tmp_path, "model.freeze", "model.freeze=[model, lm_head]")


def test_fsdp_pattern_matching_nothing(capsys, tmp_path):
    line = _only(capsys, tmp_path, "parallel.fsdp_plan.apply_modules[0]", "parallel.fsdp_plan.apply_modules=['model.layers.{*}']")
    assert "model.language_model.layers.{*}" in line


def test_unknown_collator(capsys, tmp_path):
    _only(capsys, tmp_path, "data.dataloader_param.collate_param.model_name", "data.dataloader_param.collate_param.model_name=pixtrall")


@pytest.mark.skipif(__import__("importlib").util.find_spec("flash_attn") is not None, reason="flash_attn is installed here")
def test_flash_attention_without_flash_attn(capsys, tmp_path):
    _only(capsys, tmp_path, "model.attn_implementation", "model.attn_implementation=flash_attention_2")


def test_missing_training_load(capsys, tmp_path):
    _only(capsys, tmp_path, "training.load", f"training.load={tmp_path / 'nowhere'}")


def test_output_dir_not_creatable(capsys, tmp_path):
    parent = tmp_path / "a_file"
    parent.write_text("")
    code, lines, captured = _check(capsys, tmp_path, f"training.output_dir={parent / 'x'}")
    assert code == 2 and lines == [f"config error: training.output_dir: {parent / 'x'} cannot be created: {parent} is a file, not a directory"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses permissions")
def test_output_dir_not_writable(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _only(capsys, tmp_path, "training.save", f"training.save={locked / 'ckpt'}")


@pytest.mark.parametrize("override,key", [
    ("training.adam_beta1=1.0", "training.adam_beta1"),
    ("training.adam_beta2=-0.1", "training.adam_beta2"),
    ("training.adam_eps=0", "training.adam_eps"),
    ("training.weight_decay=-0.01", "training.weight_decay"),
    ("training.clip_grad=.inf", "training.clip_grad"),
    ("training.seed=4294967296", "training.seed"),
    ("data.dataset_param.synthetic.seed=-1", "data.dataset_param.synthetic.seed"),
])
def test_value_ranges(capsys, tmp_path, override, key):
    _only(capsys, tmp_path, key, override)


def test_profile_steps_within_train_iters(capsys, tmp_path):
    _only(capsys, tmp_path, "tools.profile.end_step", "tools.profile.enable=true", "training.train_iters=2", "tools.profile.end_step=3")


@pytest.mark.parametrize("key,value,closest", [
    ("data.dataset_param.preprocess_parameters.template", "mistrall", "mistral"),
    ("data.dataset_param.preprocess_parameters.image_plugin", "pixtrall", "pixtral"),
    ("data.dataset_param.dataset_type", "huggingfce", "huggingface"),
])
def test_unknown_registry_names_suggest_the_closest(capsys, tmp_path, key, value, closest):
    line = _only(capsys, tmp_path, key, f"{key}={value}")
    assert f"did you mean '{closest}'" in line


def test_recompute_pattern_matching_nothing(capsys, tmp_path):
    line = _only(capsys, tmp_path, "parallel.recompute_plan.apply_modules[0]", "parallel.recompute=true",
                 "parallel.recompute_plan.apply_modules=['model.layers.{*}']")
    assert "model.language_model.layers.{*}" in line


def test_missing_dataset_file_and_dataset_dir_are_both_named(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    code, lines, captured = _check(capsys, tmp_path, "data.dataset_param.dataset_type=huggingface",
                                   f"data.dataset_param.basic_parameters.dataset={missing / 'train.jsonl'}",
                                   f"data.dataset_param.basic_parameters.dataset_dir={missing}")
    assert code == 2 and "Traceback" not in captured.err
    assert [line.split(":")[1].strip() for line in lines] == [
        "data.dataset_param.basic_parameters.dataset", "data.dataset_param.basic_parameters.dataset_dir"], captured.err


def test_cache_dir_not_creatable(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _only(capsys, tmp_path, "data.dataset_param.basic_parameters.cache_dir", f"data.dataset_param.basic_parameters.cache_dir={blocker / 'cache'}")


def test_nan_float(capsys, tmp_path):
    assert "nan" in _only(capsys, tmp_path, "training.lr", "training.lr=.nan")


@pytest.mark.slow  # the app as a subprocess
def test_several_problems_reported_together(tmp_path):
    out = subprocess.run(
        [sys.executable, "apps/train", str(TINY), "model.freeze=[model.visual]", "--check", "training.adam_eps=0",
         "--nproc-per-node", "2", "data.dataloader_param.collate_param.model_name=nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in out.stderr.splitlines() if line.startswith("config error: ")]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [line.split(":")[1].strip() for line in lines] == [
        "training.adam_eps", "data.dataloader_param.collate_param.model_name", "model.freeze[0]",
    ], out.stderr


LORA = ("training.lora.enable=true",)


def test_lora_target_matching_nothing_names_the_closest(capsys, tmp_path):
    line = _only(capsys, tmp_path, "training.lora.target_modules[1]", *LORA, "training.lora.target_modules=[v_proj, q_prj]")
    assert "q_proj" in line


def test_lora_target_that_is_not_a_linear_layer(capsys, tmp_path):
    line = _only(capsys, tmp_path, "training.lora.target_modules[0]", *LORA,
                 "training.lora.target_modules=['model.language_model.layers.{*}.mlp']")
    assert "nn.Linear" in line


def test_lora_freezing_every_target(capsys, tmp_path):
    _only(capsys, tmp_path, "model.freeze", *LORA, "training.lora.target_modules=[q_proj]",
          "model.freeze=[model.language_model, model.vision_tower]")


def test_lora_pretrained_path_that_is_not_an_adapter(capsys, tmp_path):
    line = _only(capsys, tmp_path, "training.lora.pretrained_lora_path", *LORA, "training.lora.target_modules=[q_proj]",
                 f"training.lora.pretrained_lora_path={tmp_path}")
    assert "adapter_config.json" in line


def test_lora_without_targets(capsys, tmp_path):
    _only(capsys, tmp_path, "training.lora.target_modules", *LORA)


@pytest.mark.parametrize("example", ["qwen3vl-tiny", "qwen3vl-moe-tiny"])
def test_lora_examples_pass(capsys, tmp_path, example):
    config = ROOT / "examples" / example / "config_lora.yaml"
    code = main([str(config), "--check", f"training.output_dir={tmp_path / 'out'}", f"training.save={tmp_path / 'ckpt'}",
                 f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}", "--nproc-per-node", "2"])
    captured = capsys.readouterr()
    assert code == 0 and "check passed: 2 processes" in captured.out, captured.err[-2000:]


def test_eta_counts_the_steps_done_since_the_timer_started(tmp_path, monkeypatch):
    clock = iter([100.0, 120.0])
    monkeypatch.setattr("mmfsdp.train.metrics.time.perf_counter", lambda: next(clock))
    fresh = MetricsWriter(tmp_path, total_steps=100)
    assert fresh.eta_s(20) == pytest.approx(20.0 / 20 * 80)  # 20 steps in 20 s, 80 left
    clock = iter([100.0, 120.0])
    resumed = MetricsWriter(tmp_path, total_steps=100, start_step=50)
    assert resumed.eta_s(60) == pytest.approx(20.0 / 10 * 40)


@pytest.mark.slow  # two fresh interpreters
def test_gen_config_reference_help_and_check():
    script = ROOT / "tools" / "gen_config_reference.py"
    doc = ROOT / "docs" / "configuration.md"
    before = doc.read_bytes()
    helped = subprocess.run([sys.executable, str(script), "-h"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--write" in helped.stdout and "--check" in helped.stdout
    checked = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr  # docs/configuration.md is current
    assert doc.read_bytes() == before


MOE = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"


def _only_moe(capsys, tmp_path, key, *overrides, nproc=2):
    code = main([str(MOE), "--check", f"training.output_dir={tmp_path / 'out'}", *overrides, "--nproc-per-node", str(nproc)])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("config error: ")]
    assert code == 2 and "Traceback" not in captured.err
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}: "), captured.err
    return lines[0]


def test_expert_parallel_passes_on_the_moe_example(capsys, tmp_path):
    code = main([str(MOE), "--check", f"training.output_dir={tmp_path / 'out'}", "parallel.expert_parallel_size=2", "--nproc-per-node", "2"])
    assert code == 0, capsys.readouterr().err


def test_expert_parallel_on_a_dense_model(capsys, tmp_path):
    line = _only(capsys, tmp_path, "parallel.expert_parallel_size", "parallel.expert_parallel_size=2")
    assert "dense" in line and "set it to 1" in line


def test_expert_parallel_not_dividing_the_experts(capsys, tmp_path):
    line = _only_moe(capsys, tmp_path, "parallel.expert_parallel_size", "parallel.expert_parallel_size=3", nproc=3)
    assert "3 does not divide the model's 8 experts" in line


def test_expert_parallel_not_dividing_the_shard_group(capsys, tmp_path):
    line = _only_moe(capsys, tmp_path, "parallel.expert_parallel_size", "parallel.expert_parallel_size=4")
    assert "does not divide the FSDP shard group of 2 ranks" in line


def test_ep_plan_matching_nothing(capsys, tmp_path):
    line = _only_moe(capsys, tmp_path, "parallel.ep_plan.apply_modules[0]", "parallel.expert_parallel_size=2",
                     "parallel.ep_plan.apply_modules=['model.layers.{*}.mlp.experts']")
    assert "model.language_model.layers.{*}.mlp.experts" in line


def test_ep_plan_matching_a_module_that_is_not_experts(capsys, tmp_path):
    line = _only_moe(capsys, tmp_path, "parallel.ep_plan.apply_modules[0]", "parallel.expert_parallel_size=2",
                     "parallel.ep_plan.apply_modules=['model.language_model.layers.{*}.mlp.gate']")
    assert "is not a fused experts module" in line
