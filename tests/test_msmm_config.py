"""MindSpeed-MM FSDP2 configs are accepted as written: aliases, ignored keys, errors, overrides, the canonical dump.

No processes: the configs are read, translated (`mmfsdp.config.foreign` with each section's `foreign_keys`),
built and checked (`--check` in this process). Training them is test_e2e_msmm.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import msmm_configs
from mmfsdp.config import Alias, ConfigError, Translate, foreign_entries, to_dict
from mmfsdp.train.cli import main
from mmfsdp.train.config import Config, load_config, read_config, save_resolved, warn_ignored_keys

ROOT = Path(__file__).resolve().parents[1]
MIGRATION = ROOT / "docs" / "migration.md"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return msmm_configs.prepare(tmp_path_factory.mktemp("msmm"))


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _cfg(tmp_path: Path, data: dict, overrides: list[str] | None = None) -> Config:
    return load_config(_write(tmp_path, yaml.safe_dump(data)), overrides)


def _nested(dotted: str, value) -> dict:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


# --------------------------------------------------------------------------- the layouts as written


@pytest.mark.parametrize("name", ["qwen3vl_30b", "qwen3vl_30b_lora", "magistral", "qwen3_5_27b", "qwen3_5_35b"])
def test_layout_passes_check_with_only_the_documented_warning(name, paths, tmp_path, capsys):
    if name == "qwen3vl_30b_lora" and msmm_configs.lora_pending():
        pytest.skip(f"pending {msmm_configs.LORA_KEY} (the LoRA branch): the LoRA variant runs once it is merged")
    config = msmm_configs.write_config(name, paths, tmp_path)
    overrides = [*msmm_configs.CPU_OVERRIDES, f"training.output_dir={tmp_path / 'out'}"]
    code = main([str(config), "--check", *overrides, "--nproc-per-node", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "config error" not in captured.err and "Traceback" not in captured.err
    assert "check passed: 2 processes" in captured.out
    warnings = [line for line in captured.out.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ignored "), warnings
    _, errors, translated = read_config(config, overrides)
    assert not errors
    documented = MIGRATION.read_text()
    for key, _ in translated.ignored:
        anchor_only = "." not in key  # a top-level key that holds a YAML anchor
        assert ("YAML anchor" if anchor_only else f"`{key}`") in documented, (
            f"{key} is ignored but not in docs/migration.md"
        )


def test_the_30b_layout_means_what_it_says(paths, tmp_path):
    cfg = load_config(msmm_configs.write_config("qwen3vl_30b", paths, tmp_path), msmm_configs.CPU_OVERRIDES)
    pre, basic = cfg.data.dataset_param.preprocess_parameters, cfg.data.dataset_param.basic_parameters
    assert (pre.cutoff_len, pre.template, pre.enable_thinking, pre.train_on_prompt, pre.mask_history) == (
        1024,
        "qwen3_vl_nothink",
        False,
        False,
        False,
    )
    assert (basic.num_proc, basic.shuffle, basic.max_samples) == (1, True, 10000)
    assert cfg.parallel.recompute and cfg.parallel.recompute_plan.apply_modules == [
        "model.visual.blocks.{*}",
        "model.language_model.layers.{*}",
    ]
    assert cfg.features.activation_offload_plan.apply_modules == ["model.language_model.layers.{*}"]
    assert cfg.features.loss_cfg.loss_type == "default" and not cfg.training.deterministic
    p = cfg.tools.profile
    assert (
        p.enable,
        p.start_step,
        p.end_step,
        p.output_dir,
        p.ranks,
        p.record_shapes,
        p.with_memory,
        p.with_stack,
        p.with_cpu,
    ) == (False, 10, 11, "./profiling", [0], False, False, False, True)
    mp = cfg.tools.memory_profile
    assert (mp.enable, mp.start_step, mp.end_step, mp.save_path, mp.dump_ranks, mp.stacks, mp.max_entries) == (
        False,
        1,
        2,
        "./memory_snapshot",
        [0],
        "all",
        None,
    )


def test_the_magistral_layout_means_what_it_says(paths, tmp_path):
    cfg = load_config(msmm_configs.write_config("magistral", paths, tmp_path), msmm_configs.CPU_OVERRIDES)
    assert cfg.features.loss_cfg.loss_type == "per_token" and cfg.features.enable_chunk_loss
    assert cfg.features.chunkloss_plan.chunk_size == 1024
    assert cfg.parallel.recompute and cfg.model.freeze == ["model.vision_tower", "model.multi_modal_projector"]
    assert cfg.data.dataset_param.preprocess_parameters.model_name_or_path == str(paths["tiny"])
    assert cfg.data.dataset_param.basic_parameters.dataset == f"{paths['data']}/train.jsonl"


# --------------------------------------------------------------------------- every alias, one by one

# (their key, a value, our key, the value we expect): every `Alias` with a target of every section.
ALIASES = [
    # MindSpeed-MM's fla switch for the Gated DeltaNet (under model:, in its April 2026 configs under features:)
    ("model.use_triton_gdn", True, "model.gdn_kernel", "fla"),
    ("features.use_triton_gdn", False, "model.gdn_kernel", "torch"),
    # preference training: LLaMA-Factory's top-level keys, theirs and MindSpeed-LLM's under training:, TRL's
    ("stage", "dpo", "training.stage", "dpo"),
    *(
        (f"{prefix}{theirs}", value, ours, value)
        for prefix in ("", "training.")
        for theirs, value, ours in (
            ("pref_beta", 0.3, "training.dpo.beta"), ("pref_loss", "ipo", "training.dpo.loss_type"),
            ("pref_ftx", 0.5, "training.dpo.rpo_alpha"), ("dpo_label_smoothing", 0.1, "training.dpo.label_smoothing"),
        )
    ),
    ("training.dpo_beta", 0.3, "training.dpo.beta", 0.3),
    ("training.dpo_loss_type", "ipo", "training.dpo.loss_type", "ipo"),
    ("training.precompute_ref_log_probs", True, "training.dpo.precompute_ref_logps", True),
    ("training.dpo.precompute_ref_log_probs", True, "training.dpo.precompute_ref_logps", True),
    # online RL: ms-swift's dynamic-sampling keys and verl's `algorithm.filter_groups.enable`, under training.grpo
    ("training.grpo.dynamic_sample", True, "training.grpo.dynamic_sampling", True),
    ("training.grpo.max_resample_times", 5, "training.grpo.max_resample_rounds", 5),
    ("training.grpo.vllm_importance_sampling_cap", 2.5, "training.grpo.vllm_importance_sampling_clip_max", 2.5),
    ("training.grpo.filter_groups.enable", True, "training.grpo.dynamic_sampling", True),
    ("data.dataset_param.basic_parameters.cutoff_len", 77, "data.dataset_param.preprocess_parameters.cutoff_len", 77),
    *(
        (f"data.dataset_param.basic_parameters.{key}", value, f"data.dataset_param.preprocess_parameters.{key}", value)
        for key, value in (
            ("video_fps", 1.0), ("video_maxlen", 16), ("video_max_pixels", 4096), ("video_min_pixels", 256),
            ("video_total_pixels", 100_000),
        )
    ),
    (
        "data.dataset_param.basic_parameters.template",
        "qwen3_vl",
        "data.dataset_param.preprocess_parameters.template",
        "qwen3_vl",
    ),
    (
        "data.dataset_param.basic_parameters.train_on_prompt",
        True,
        "data.dataset_param.preprocess_parameters.train_on_prompt",
        True,
    ),
    (
        "data.dataset_param.basic_parameters.mask_history",
        True,
        "data.dataset_param.preprocess_parameters.mask_history",
        True,
    ),
    (
        "data.dataset_param.basic_parameters.enable_thinking",
        False,
        "data.dataset_param.preprocess_parameters.enable_thinking",
        False,
    ),
    (
        "data.dataset_param.basic_parameters.preprocessing_num_workers",
        3,
        "data.dataset_param.basic_parameters.num_proc",
        3,
    ),
    (
        "data.dataset_param.basic_parameters.val_dataset",
        "v.jsonl",
        "data.dataset_param.basic_parameters.eval_dataset",
        "v.jsonl",
    ),
    ("data.dataloader_param.shuffle", False, "data.dataset_param.basic_parameters.shuffle", False),
    (
        "data.dataloader_param.collate_param.collator_id",
        "qwen3vl",
        "data.dataloader_param.collate_param.model_name",
        "qwen3vl",
    ),
    ("model.loss_cfg", {"loss_type": "per_sample_loss"}, "features.loss_cfg", {"loss_type": "per_sample"}),
    ("model.enable_chunk_loss", True, "features.enable_chunk_loss", True),
    ("model.encoder_data_balance", True, "data.dataloader_param.balance", True),
    ("features.torch_compile", True, "features.compile", True),
    ("features.use_torch_compile", True, "features.compile", True),
    ("features.enable_compile", True, "features.compile", True),
    (
        "model.chunkloss_plan",
        {"apply_module": "lm_head", "chunk_size": 64},
        "features.chunkloss_plan",
        {"chunk_size": 64},
    ),
    (
        "model.activation_offload_plan",
        {"apply_modules": ["lm_head"]},
        "features.activation_offload_plan",
        {"apply_modules": ["lm_head"]},
    ),
    ("model.recompute", True, "parallel.recompute", True),
    (
        "model.recompute_plan",
        {"apply_modules": ["a.{*}"], "use_reentrant": False},
        "parallel.recompute_plan",
        {"apply_modules": ["a.{*}"]},
    ),
    ("features.recompute", True, "parallel.recompute", True),
    ("features.recompute_plan", {"apply_modules": ["a.{*}"]}, "parallel.recompute_plan", {"apply_modules": ["a.{*}"]}),
    ("training.use_deter_comp", True, "training.deterministic", True),
    ("training.val_micro_batch_size", 3, "training.eval_batch_size", 3),
    ("tools.profile.static_param.start_step", 4, "tools.profile.start_step", 4),
    ("tools.profile.static_param.end_step", 6, "tools.profile.end_step", 6),
    ("tools.profile.static_param.record_shapes", False, "tools.profile.record_shapes", False),
    ("tools.profile.static_param.with_memory", False, "tools.profile.with_memory", False),
    ("tools.profile.static_param.with_stack", True, "tools.profile.with_stack", True),
    ("tools.profile.static_param.with_cpu", False, "tools.profile.with_cpu", False),
    ("tools.profile.static_param.save_path", "prof", "tools.profile.output_dir", "prof"),
    ("report_to", "wandb", "tools.report_to", ["wandb"]),
    ("logging_dir", "tb", "tools.tensorboard_dir", "tb"),
    ("run_name", "sft", "tools.run_name", "sft"),
    ("training.report_to", ["tensorboard"], "tools.report_to", ["tensorboard"]),
    ("training.logging_dir", "tb", "tools.tensorboard_dir", "tb"),
    ("training.run_name", "sft", "tools.run_name", "sft"),
    ("training.tensorboard_dir", "tb", "tools.tensorboard_dir", "tb"),
    ("training.wandb_project", "proj", "tools.wandb_project", "proj"),
    ("training.wandb_exp_name", "exp", "tools.run_name", "exp"),
    ("training.wandb_save_dir", "wb", "tools.wandb_dir", "wb"),
    ("tools.logging_dir", "tb", "tools.tensorboard_dir", "tb"),
]
VALUE_ALIASES = [
    ("features.loss_cfg.loss_type", "per_sample_loss", "per_sample"),
    ("features.loss_cfg.loss_type", "per_token_loss", "per_token"),
    ("training.save_format", "auto", "dcp"),
]


def test_every_alias_of_the_tables_is_tested_here():
    tables = {path for path, entry in foreign_entries(Config) if isinstance(entry, Alias) and entry.target is not None}
    assert tables == {theirs for theirs, *_ in ALIASES}
    values = {
        (path, k)
        for path, entry in foreign_entries(Config)
        if isinstance(entry, Alias) and entry.target is None
        for k in entry.values
    }
    assert values == {(path, theirs) for path, theirs, _ in VALUE_ALIASES}


@pytest.mark.parametrize("theirs, value, ours, expected", ALIASES, ids=[a[0] for a in ALIASES])
def test_alias_builds_the_same_config_as_our_key(theirs, value, ours, expected, tmp_path):
    mine = _cfg(tmp_path, _nested(theirs, value))
    assert to_dict(mine) == to_dict(_cfg(tmp_path, _nested(ours, expected)))
    assert to_dict(mine) != to_dict(_cfg(tmp_path, {})), f"{theirs}: the test value should differ from the default"


@pytest.mark.parametrize("key, theirs, ours", VALUE_ALIASES)
def test_value_alias(key, theirs, ours, tmp_path):
    assert to_dict(_cfg(tmp_path, _nested(key, theirs))) == to_dict(_cfg(tmp_path, _nested(key, ours)))


def test_old_and_new_layouts_of_the_features_are_one_config(tmp_path):
    """MindSpeed-MM moved loss, chunk loss, offload and recompute from `model:`/`parallel:` to `features:`."""
    settings = {
        "loss_cfg": {"loss_type": "per_token_loss", "router_aux_loss_coef": 0.0},
        "enable_chunk_loss": True,
        "chunkloss_plan": {"apply_module": "lm_head", "chunk_size": 256},
        "activation_offload_plan": {"apply_modules": ["model.language_model.layers.{*}"]},
        "recompute": True,
        "recompute_plan": {"apply_modules": ["model.language_model.layers.{*}"]},
    }
    recompute = {k: settings[k] for k in ("recompute", "recompute_plan")}
    rest = {k: v for k, v in settings.items() if k not in recompute}
    layouts = [
        {"model": settings},
        {"model": rest, "parallel": recompute},
        {"features": settings},
    ]
    built = [to_dict(_cfg(tmp_path, layout)) for layout in layouts]
    assert built[0] == built[1] == built[2]
    assert built[0]["parallel"]["recompute"] and built[0]["features"]["loss_cfg"]["loss_type"] == "per_token"


# --------------------------------------------------------------------------- ignored keys, errors


def test_ignored_keys_make_one_warning_line_with_reasons(tmp_path):
    text = "HF: &HF /models/x\ntraining:\n  plugin: [a]\n  adam_fused: true\ndata:\n  dataloader_param:\n    sampler_type: BaseRandomBatchSampler\n"
    _, _, translated = read_config(_write(tmp_path, text))
    line = translated.warning()
    assert "\n" not in line and line.startswith("ignored 4 key(s) of another schema (docs/migration.md): ")
    for key in ("HF", "training.plugin", "training.adam_fused", "data.dataloader_param.sampler_type"):
        assert key in line
    assert "registered packages" in line and "YAML anchor" in line
    assert read_config(_write(tmp_path, "training:\n  lr: 1.0e-4\n"))[2].warning() is None


def test_the_warning_is_logged_once_and_on_rank_0_only(tmp_path, monkeypatch):
    import logging

    from mmfsdp.config import get_logger

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    handler.addFilter(get_logger().handlers[0].filters[0])  # the rank-0 filter of the one handler
    get_logger().addHandler(handler)
    try:
        on_rank_1 = read_config(_write(tmp_path, "training:\n  plugin: [a]\n  no_save_rng: true\n"))[2]
        monkeypatch.setenv("RANK", "1")
        warn_ignored_keys(on_rank_1)
        assert records == []
        on_rank_0 = read_config(
            _write(tmp_path, "training:\n  plugin: [a]\n  quantization_plan: {recipe_name: mxfp8}\n")
        )[2]
        monkeypatch.setenv("RANK", "0")
        warn_ignored_keys(on_rank_0)
        warn_ignored_keys(on_rank_0)
        assert len(records) == 1 and "training.plugin" in records[0] and "training.quantization_plan" in records[0]
    finally:
        get_logger().removeHandler(handler)


@pytest.mark.parametrize(
    "text, key, message",
    [
        (
            "data:\n  dataloader_param:\n    collate_param:\n      ignore_pad_token_for_loss: false\n",
            "data.dataloader_param.collate_param.ignore_pad_token_for_loss",
            r"False is not supported: padding never counts in the loss; remove the key or set it to true",
        ),
        (
            "data:\n  dataloader_param:\n    dataloader_mode: stream\n",
            "data.dataloader_param.dataloader_mode",
            "'stream' is not supported",
        ),
        (
            "features:\n  chunkloss_plan:\n    apply_module: model.lm_head\n",
            "features.chunkloss_plan.apply_module",
            "set it to lm_head",
        ),
        ("tools:\n  profile:\n    profile_type: dynamic\n", "tools.profile.profile_type", "set it to static"),
    ],
)
def test_ignored_key_with_a_value_mmfsdp_cannot_honour_is_an_error(tmp_path, text, key, message):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*{message}"):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    "text, error",
    [
        (
            "training:\n  use_deter_compp: true\n",
            r"^training\.use_deter_compp: unknown key \(did you mean 'training\.use_deter_comp'\?\)",
        ),
        ("training:\n  lerning_rate: 1\n", r"^training\.lerning_rate: unknown key"),
        (
            "data:\n  dataloader_param:\n    sampler_typ: x\n",
            r"^data\.dataloader_param\.sampler_typ: unknown key \(did you mean 'data\.dataloader_param\.sampler_type'\?\)",
        ),
        (
            "tools:\n  profile:\n    static_param:\n      levle: level1\n",
            r"^tools\.profile\.static_param\.levle: unknown key \(did you mean 'tools\.profile\.static_param\.level'\?\)",
        ),
        ("gpt_args:\n  seq_length: 4\n", r"^gpt_args: unknown key"),
        ("MM_TOOL_PATH: ./tools.json\n", r"^MM_TOOL_PATH: unknown key"),  # a top-level key without an anchor
    ],
)
def test_keys_of_neither_schema_stay_errors_with_the_closest_key(tmp_path, text, error):
    with pytest.raises(ConfigError, match=error):
        load_config(_write(tmp_path, text))


def test_both_spellings_with_different_values_is_an_error(tmp_path):
    text = "data:\n  dataset_param:\n    preprocess_parameters:\n      cutoff_len: 512\n    basic_parameters:\n      cutoff_len: 1024\n"
    with pytest.raises(
        ConfigError,
        match=r"^data\.dataset_param\.basic_parameters\.cutoff_len: 1024 conflicts with data\.dataset_param\.preprocess_parameters\.cutoff_len: 512",
    ):
        load_config(_write(tmp_path, text))
    same = text.replace("1024", "512")
    assert load_config(_write(tmp_path, same)).data.dataset_param.preprocess_parameters.cutoff_len == 512


# --------------------------------------------------------------------------- overrides, val_dataset_param, the dump


def test_overrides_in_either_spelling_win_over_the_file_in_either_spelling(tmp_path):
    theirs = _write(tmp_path, "data:\n  dataset_param:\n    basic_parameters:\n      cutoff_len: 1024\n", "theirs.yaml")
    ours = _write(
        tmp_path, "data:\n  dataset_param:\n    preprocess_parameters:\n      cutoff_len: 1024\n", "ours.yaml"
    )
    for path in (theirs, ours):
        for key in (
            "data.dataset_param.basic_parameters.cutoff_len",
            "data.dataset_param.preprocess_parameters.cutoff_len",
        ):
            assert load_config(path, [f"{key}=64"]).data.dataset_param.preprocess_parameters.cutoff_len == 64
    cfg = load_config(
        ours, ["features.loss_cfg.loss_type=per_token_loss", "training.use_deter_comp=true", "model.recompute=true"]
    )
    assert (cfg.features.loss_cfg.loss_type, cfg.training.deterministic, cfg.parallel.recompute) == (
        "per_token",
        True,
        True,
    )
    _, _, translated = read_config(ours, ["training.plugin=[x]"])
    assert [key for key, _ in translated.ignored] == ["training.plugin"]
    with pytest.raises(
        ConfigError,
        match=r"^training\.use_deter_comp: expected true or false|^training\.deterministic: expected true or false",
    ):
        load_config(ours, ["training.use_deter_comp=maybe"])


def test_val_dataset_param_becomes_the_evaluation_files(tmp_path):
    text = """\
data:
  dataset_param: &TRAIN
    dataset_type: huggingface
    preprocess_parameters:
      model_name_or_path: /models/x
    basic_parameters: &BASIC
      cutoff_len: 1024
      template: qwen3_vl_nothink
      dataset: train.jsonl
      cache_dir: ./cache
  val_dataset_param:
    <<: *TRAIN
    basic_parameters:
      <<: *BASIC
      dataset: val.jsonl
      cache_dir: ./cache/val
training:
  val_interval: 100
  val_micro_batch_size: 2
"""
    cfg = load_config(_write(tmp_path, text))
    basic = cfg.data.dataset_param.basic_parameters
    assert (basic.dataset, basic.eval_dataset, cfg.training.val_interval, cfg.training.eval_batch_size) == (
        "train.jsonl",
        "val.jsonl",
        100,
        2,
    )
    with pytest.raises(
        ConfigError,
        match=r"^data\.val_dataset_param\.basic_parameters\.cutoff_len: differs from data\.dataset_param\.basic_parameters\.cutoff_len",
    ):
        load_config(
            _write(
                tmp_path,
                text.replace("      cache_dir: ./cache/val\n", "      cache_dir: ./cache/val\n      cutoff_len: 64\n"),
            )
        )
    with pytest.raises(ConfigError, match=r"^training\.val_interval: 100 needs evaluation data"):
        load_config(_write(tmp_path, "training:\n  val_interval: 100\n"))


def test_resolved_config_is_written_once_in_our_spelling(paths, tmp_path):
    """`<output_dir>/config.yaml` holds only our keys; read back, it is the same config and warns about nothing."""
    source = msmm_configs.write_config("magistral", paths, tmp_path)
    cfg = load_config(source, msmm_configs.CPU_OVERRIDES)
    written = save_resolved(cfg, tmp_path / "out")
    again, errors, translated = read_config(written)
    assert not errors and translated.warning() is None and not translated.renamed
    assert to_dict(again) == to_dict(cfg)
    text = written.read_text()
    for theirs in (
        "basic_parameters:\n      cutoff_len",
        "per_token_loss",
        "\n  plugin:",
        "adam_fused",
        "HF_MODEL_LOAD_PATH",
        "static_param",
    ):
        assert theirs not in text


def test_migration_doc_lists_every_foreign_key():
    text = MIGRATION.read_text()
    missing = [path for path, _ in foreign_entries(Config) if f"`{path}`" not in text]
    assert not missing, f"docs/migration.md does not list: {missing}"
    assert all(isinstance(entry, (Alias, Translate)) or entry.reason for _, entry in foreign_entries(Config))


def test_mm_data_reads_the_mindspeed_layout(paths, tmp_path, capsys):
    from mmfsdp.data.cli import main as mm_data

    config = msmm_configs.write_config("qwen3vl_30b", paths, tmp_path)
    code = mm_data(
        ["inspect", str(config), "data.dataset_param.basic_parameters.preprocessing_num_workers=1", "--index", "0"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "mm-data: warning: ignored" in captured.err and "a " in captured.out
