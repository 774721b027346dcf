"""Context-parallel config checks: one clear line naming the key, before any process group."""

from pathlib import Path

import pytest
import torch.distributed as dist

from mmfsdp.config import ConfigError
from mmfsdp.model import get_model_entry
from mmfsdp.train.cli import main
from mmfsdp.train.config import check_world, load_config

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"  # 4 attention heads, 2 KV heads


def _model_dir(tmp_path: Path, **text) -> str:
    path = tmp_path / "model"
    get_model_entry("mistral3").testkit.tiny_config(text_config=text).save_pretrained(path)
    return str(path)


def _config(*overrides: str):
    return load_config(TINY, [f"model.model_name_or_path={ROOT / 'examples' / 'tiny' / 'assets'}", *overrides])


def test_ulysses_size_must_divide_the_attention_heads(tmp_path):
    cfg = _config("parallel.ulysses_parallel_size=3")
    with pytest.raises(ConfigError, match=r"^parallel\.ulysses_parallel_size: 3 does not divide 4 attention heads$"):
        check_world(cfg, 3)
    big = _model_dir(tmp_path, num_attention_heads=32, num_key_value_heads=8, head_dim=2)
    cfg = _config("parallel.ulysses_parallel_size=3", f"model.model_name_or_path={big}")
    with pytest.raises(ConfigError, match=r"^parallel\.ulysses_parallel_size: 3 does not divide 32 attention heads$"):
        check_world(cfg, 6)


def test_fewer_kv_heads_than_the_ulysses_size_is_fine():
    plan = check_world(_config("parallel.ulysses_parallel_size=4"), 4)  # 2 KV heads are repeated
    assert (plan.ulysses, plan.ring, plan.dp_shard) == (4, 1, 1)
    plan = check_world(_config("parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2"), 8)
    assert (plan.dp_shard, plan.ring, plan.ulysses) == (2, 2, 2)


def test_cp_size_must_divide_the_world_size():
    with pytest.raises(ConfigError, match=r"^parallel\.ulysses_parallel_size: 4 does not divide fully_shard_parallel_size 6"):
        check_world(_config("parallel.ulysses_parallel_size=4"), 6)
    with pytest.raises(ConfigError, match=r"^parallel\.ring_attention_size: ring_attention_size 2 × ulysses_parallel_size 2 = 4 does not divide"):
        check_world(_config("parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2"), 6)


def test_packed_rows_must_be_a_multiple_of_what_cp_splits_by():
    packed = ["data.dataset_param.basic_parameters.packing=true", "parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2"]
    with pytest.raises(
        ConfigError,
        match=r"^data\.dataset_param\.preprocess_parameters\.cutoff_len: 100 is not a positive multiple of 8 "
        r"\(2 × ring_attention_size 2 × ulysses_parallel_size 2\), which context parallel needs$",
    ):
        check_world(_config(*packed, "data.dataset_param.preprocess_parameters.cutoff_len=100"), 4)
    check_world(_config(*packed, "data.dataset_param.preprocess_parameters.cutoff_len=104"), 4)
    # without packing rows are padded to the multiple, so any cutoff works
    check_world(_config("parallel.ulysses_parallel_size=2", "data.dataset_param.preprocess_parameters.cutoff_len=101"), 2)


def test_a_sliding_window_is_refused_under_cp(tmp_path):
    windowed = _model_dir(tmp_path, sliding_window=64)
    with pytest.raises(ConfigError, match=r"^model\.model_name_or_path: text_config\.sliding_window is 64"):
        check_world(_config("parallel.ulysses_parallel_size=2", f"model.model_name_or_path={windowed}"), 2)
    check_world(_config(f"model.model_name_or_path={windowed}"), 2)  # no CP: no check


def test_cli_reports_the_head_error_in_one_line_without_a_process_group(capsys):
    code = main([str(TINY), f"model.model_name_or_path={ROOT / 'examples' / 'tiny' / 'assets'}", "parallel.ulysses_parallel_size=3", "--nproc-per-node", "3", "--check"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["config error: parallel.ulysses_parallel_size: 3 does not divide 4 attention heads"]
    assert not dist.is_initialized()
