"""Config errors are one clear line naming the key, before any process group starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from mmfsdp.config import ConfigError
from mmfsdp.train.config import Config, check_world, load_config
from mmfsdp.train.reference import missing_docs, render

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_tiny_example_config_loads_and_fits_two_ranks():
    cfg = load_config(TINY)
    check_world(cfg, 2)
    assert cfg.model.model_id == "mistral3"


def test_padding_free_follows_the_family_unless_set():
    """Null `padding_free` takes the family's packing capability (every family in the tree packs); an explicit
    value stays."""
    from mmfsdp.model import get_model_entry

    cfg = load_config(TINY)
    assert cfg.data.dataloader_param.padding_free is get_model_entry("mistral3").capabilities.packing is True
    assert load_config(TINY, ["data.dataloader_param.padding_free=false"]).data.dataloader_param.padding_free is False


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "training:\n  lerning_rate: 1\n  micro_batch_sise: 2\n"))
    assert str(err.value).startswith("training.lerning_rate: unknown key")
    with pytest.raises(ConfigError, match=r"^training\.micro_batch_sise: unknown key \(did you mean 'training\.micro_batch_size'\?\)"):
        load_config(_write(tmp_path, "training:\n  micro_batch_sise: 2\n"))
    with pytest.raises(ConfigError, match=r"^trainig: unknown key \(did you mean 'training'\?\)"):
        load_config(_write(tmp_path, "trainig: {}\n"))


def test_bad_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"^training\.train_iters: expected an integer, got 'ten'$"):
        load_config(_write(tmp_path, "training:\n  train_iters: ten\n"))
    with pytest.raises(ConfigError, match=r"^training\.lr_decay_style: 'cosin' is not one of .*did you mean 'cosine'"):
        load_config(_write(tmp_path, "training:\n  lr_decay_style: cosin\n"))


def test_override_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^training\.lr: expected a number"):
        load_config(_write(tmp_path, "{}\n"), ["training.lr=fast"])


def test_bad_mesh_size_is_a_config_error(tmp_path):
    cfg = load_config(_write(tmp_path, "parallel:\n  ulysses_parallel_size: 3\n"))
    with pytest.raises(ConfigError, match=r"^parallel\.ulysses_parallel_size: 3 "):
        check_world(cfg, 8)
    with pytest.raises(ConfigError, match=r"^parallel\.tensor_parallel_size"):
        load_config(_write(tmp_path, "parallel:\n  tensor_parallel_size: 2\n"))


def test_meta_init_needs_a_load_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^training\.init_model_with_meta_device: true needs training\.load"):
        load_config(_write(tmp_path, "training:\n  init_model_with_meta_device: true\n"))


@pytest.mark.slow  # the app as a subprocess
def test_cli_prints_one_line_and_no_traceback(tmp_path):
    bad = _write(tmp_path, "training:\n  micro_batch_sise: 2\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "apps" / "train"), str(bad), "--nproc-per-node", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: training.micro_batch_sise: unknown key (did you mean 'training.micro_batch_size'?); "
        + proc.stderr.split("; ", 1)[1].strip()
    ]


def test_every_key_is_documented_and_reference_is_current():
    assert missing_docs(Config) == []
    assert (ROOT / "docs" / "configuration.md").read_text() == render(Config), (
        "docs/configuration.md is stale: run `uv run python tools/gen_config_reference.py`"
    )


def test_compile_keys_and_their_other_names(tmp_path):
    cfg = load_config(_write(tmp_path, "{}\n"))
    assert cfg.features.compile is False and cfg.parallel.fsdp_plan.min_group_params == 4_000_000
    for name in ("torch_compile", "use_torch_compile", "enable_compile"):
        assert load_config(_write(tmp_path, f"features:\n  {name}: true\n")).features.compile is True
    cfg = load_config(_write(tmp_path, "features:\n  compile: true\n  compile_plan:\n    backend: aot_eager\n"))
    assert (cfg.features.compile, cfg.features.compile_plan.backend, cfg.features.compile_plan.dynamic) == (
        True, "aot_eager", None)
    cfg = load_config(_write(tmp_path, "features:\n  compile_plan:\n    dynamic: true\n"))
    assert cfg.features.compile_plan.dynamic is True
    with pytest.raises(ConfigError, match=r"^features\.compile_plan\.backend: must be a torch.compile backend"):
        load_config(_write(tmp_path, "features:\n  compile_plan:\n    backend: ''\n"))
    with pytest.raises(ConfigError, match=r"^parallel\.fsdp_plan\.min_group_params: must be >= 0"):
        load_config(_write(tmp_path, "parallel:\n  fsdp_plan:\n    min_group_params: -1\n"))
