"""`mm-convert GenericDCPConverter hf_to_dcp / dcp_to_hf`: bit-exact round trips, naming, assets, errors, help."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mmfsdp.ckpt import SafetensorsDir, load_checkpoint, read_tracker, save_checkpoint
from mmfsdp.ckpt.cli import _build_parser, main

ASSETS = {
    "config.json": json.dumps({"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2}),  # no model_type: identity
    "generation_config.json": "{}",
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": "{}",
    "preprocessor_config.json": "{}",
    "chat_template.jinja": "{{ messages }}",
}


def _toy_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"embed_tokens.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16)}
    for layer in range(2):
        tensors[f"layers.{layer}.attn.weight"] = torch.randn(8, 8, generator=gen)
        tensors[f"layers.{layer}.mlp.weight"] = torch.randn(24, 8, generator=gen).to(torch.bfloat16)
        tensors[f"layers.{layer}.norm.weight"] = torch.rand(8, generator=gen)
    tensors["norm.weight"] = torch.ones(8)
    tensors["lm_head.weight"] = torch.randn(16, 8, generator=gen)
    tensors["step"] = torch.tensor(3, dtype=torch.int64)
    return tensors


def _write_hf(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 3, assets: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for index in range(shards):
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[index::shards]}
        save_file(part, directory / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    for name, text in (ASSETS if assets is None else assets).items():
        (directory / name).write_text(text)
    return directory


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key


def _convert(*argv: str) -> int:
    return main(["GenericDCPConverter", *map(str, argv)])


def test_hf_dcp_hf_round_trip_is_bit_exact(tmp_path):
    tensors = _toy_tensors()
    hf = _write_hf(tmp_path / "hf", tensors)
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 0
    assert read_tracker(tmp_path / "dcp") == "release"
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["latest_checkpointed_iteration.txt", "release"]

    assert _convert("dcp_to_hf", "--load_dir", tmp_path / "dcp", "--save_dir", tmp_path / "out",
                    "--model_assets_dir", hf, "--max_shard_size", "700B") == 0
    out = tmp_path / "out"
    _assert_bit_exact(_read_all(out), tensors)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shard_files) > 3 and sorted(set(index["weight_map"].values())) == shard_files
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name in shard_files:
        with safe_open(os.fspath(out / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert os.path.getsize(out / name) < 700 + 2000 or len(list(f.keys())) == 1  # 700 B of data + header
    for name, text in ASSETS.items():
        assert (out / name).read_text() == text
    # --load_dir may also name the release directory itself
    assert _convert("dcp_to_hf", "--load_dir", tmp_path / "dcp" / "release", "--save_dir", tmp_path / "out2",
                    "--model_assets_dir", hf) == 0
    assert [p.name for p in (tmp_path / "out2").glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    _assert_bit_exact(_read_all(tmp_path / "out2"), tensors)


def test_release_loads_into_the_model_and_training_checkpoints_export(tmp_path):
    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(16, 8, dtype=torch.bfloat16)
            self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
            for layer in self.layers:
                layer.attn = torch.nn.Linear(8, 8, bias=False)
                layer.mlp = torch.nn.Linear(8, 24, bias=False, dtype=torch.bfloat16)
                layer.norm = torch.nn.Module()
                layer.norm.weight = torch.nn.Parameter(torch.zeros(8))
            self.norm = torch.nn.Module()
            self.norm.weight = torch.nn.Parameter(torch.zeros(8))
            self.lm_head = torch.nn.Linear(8, 16, bias=False)
            self.register_buffer("step", torch.tensor(0, dtype=torch.int64))

    tensors = _toy_tensors()
    hf = _write_hf(tmp_path / "hf", tensors)
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 0
    model = Toy()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.dtype == torch.float32])
    loaded = load_checkpoint(tmp_path / "dcp", model=model, optimizer=optimizer)  # release: model only
    assert loaded.iteration == "release" and optimizer.state == {}
    _assert_bit_exact({k: v for k, v in model.state_dict().items()}, tensors)

    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    save_checkpoint(tmp_path / "train", 5, model=model, optimizer=optimizer)
    assert _convert("dcp_to_hf", "--load_dir", tmp_path / "train", "--save_dir", tmp_path / "out",
                    "--model_assets_dir", hf) == 0
    _assert_bit_exact(_read_all(tmp_path / "out"), {k: v.clone() for k, v in model.state_dict().items()})


def test_renamed_file_names_round_trip_through_state_dict_names(tmp_path, toy_adapters):
    legacy = {
        "legacy.embed_tokens.weight": torch.randn(16, 8),
        "legacy.layers.0.mlp.weight": torch.randn(4, 8).to(torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8),
    }
    config = {"model_type": "toy_prefix", "text_config": {"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1}}
    hf = _write_hf(tmp_path / "hf", legacy, shards=2, assets={"config.json": json.dumps(config)})
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 0
    from mmfsdp.ckpt.dcp_io import read_dcp_metadata

    keys = sorted(read_dcp_metadata(tmp_path / "dcp" / "release").state_dict_metadata)
    assert keys == sorted(["model.model.embed_tokens.weight", "model.model.layers.0.mlp.weight", "model.lm_head.weight"])
    assert _convert("dcp_to_hf", "--load_dir", tmp_path / "dcp", "--save_dir", tmp_path / "out", "--model_assets_dir", hf) == 0
    _assert_bit_exact(_read_all(tmp_path / "out"), legacy)
    # the adapter chosen by model id (and the old --key_map spelling) gives the same files
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp2", "--key_map", "toy_prefix") == 0
    assert _convert("dcp_to_hf", "--load_dir", tmp_path / "dcp2", "--save_dir", tmp_path / "out2", "--model_assets_dir", hf,
                    "--model_id", "toy_prefix") == 0
    _assert_bit_exact(_read_all(tmp_path / "out2"), legacy)


def _error(capsys, *argv) -> str:
    assert _convert(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mm-convert: error: ") and "Traceback" not in err
    return err


def test_hf_to_dcp_bad_inputs(tmp_path, capsys):
    assert "does not exist" in _error(capsys, "hf_to_dcp", "--hf_dir", tmp_path / "nope", "--dcp_dir", tmp_path / "d")
    (tmp_path / "empty").mkdir()
    assert "no safetensors weights" in _error(capsys, "hf_to_dcp", "--hf_dir", tmp_path / "empty", "--dcp_dir", tmp_path / "d")
    hf = _write_hf(tmp_path / "hf", _toy_tensors())
    (hf / "model.safetensors.index.json").unlink()
    assert "no model.safetensors.index.json" in _error(capsys, "hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "d")
    assert not (tmp_path / "d").exists()

    hf = _write_hf(tmp_path / "hf2", _toy_tensors())
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert "not empty" in _error(capsys, "hf_to_dcp", "--hf_dir", hf, "--dcp_dir", out)
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", out, "--force") == 0
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", out, "--force") == 0  # replaces release/
    assert sorted(p.name for p in out.iterdir()) == ["latest_checkpointed_iteration.txt", "notes.txt", "release"]


def test_dcp_to_hf_bad_inputs(tmp_path, capsys):
    tensors = _toy_tensors()
    hf = _write_hf(tmp_path / "hf", tensors)
    dcp_dir = tmp_path / "dcp"
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", dcp_dir) == 0

    def export(load=dcp_dir, save=tmp_path / "out", assets=hf, *extra):
        return _error(capsys, "dcp_to_hf", "--load_dir", load, "--save_dir", save, "--model_assets_dir", assets, *extra)

    assert "no latest_checkpointed_iteration.txt" in export(load=tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "latest_checkpointed_iteration.txt").write_text("100")
    assert "points at 100" in export(load=tmp_path / "t")
    assert "--model_assets_dir" in export(assets=tmp_path / "nope")
    (tmp_path / "no_config").mkdir()
    assert "has no config.json" in export(assets=tmp_path / "no_config")
    assert "same directory as --model_assets_dir" in export(save=hf, assets=hf)

    # assets whose weights disagree with the checkpoint: an extra key, a missing key and a changed shape
    other = dict(tensors)
    other["layers.2.attn.weight"] = other.pop("layers.1.attn.weight")
    other["norm.weight"] = torch.ones(9)
    err = export(assets=_write_hf(tmp_path / "other", other))
    assert "layers.2.attn.weight" in err and "layers.1.attn.weight" in err and "norm.weight: checkpoint (8,), assets (9,)" in err

    # assets with only a config: checked against vocab_size / hidden_size / num_hidden_layers
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps({"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1}))
    err = export(assets=config_only)
    assert "embed_tokens.weight: shape (16, 8), config says (32, 8)" in err
    assert "layers.1.attn.weight: layer 1 but num_hidden_layers = 1" in err

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert "not empty" in export(save=busy)
    assert _convert("dcp_to_hf", "--load_dir", dcp_dir, "--save_dir", busy, "--model_assets_dir", hf, "--force") == 0
    assert not (busy / "x").exists()
    assert "cannot parse size" in export(tmp_path / "dcp", tmp_path / "o3", hf, "--max_shard_size", "lots")
    assert not any(p.name.startswith(".o") for p in tmp_path.iterdir())  # no temporary output left behind


def _parsers(parser: argparse.ArgumentParser, prefix: tuple = ()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*prefix, name))


def test_help_documents_every_flag(capsys):
    levels = dict(_parsers(_build_parser()))
    assert set(levels) == {(), ("GenericDCPConverter",), ("GenericDCPConverter", "hf_to_dcp"),
                           ("GenericDCPConverter", "dcp_to_hf"), ("LoraConverter",),
                           ("LoraConverter", "dcp_to_peft"), ("LoraConverter", "dcp_to_merged_hf")}
    for prefix, parser in levels.items():
        with pytest.raises(SystemExit) as exit_info:
            main([*prefix, "-h"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert parser.description and " ".join(parser.description.split()[:4]) in " ".join(text.split())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.dest in text and choice.help, choice.dest
            elif "-h" not in action.option_strings:
                assert action.help, action.option_strings
                assert all(flag in text for flag in action.option_strings)
    hf_to_dcp_flags = {a.option_strings[0] for a in levels[("GenericDCPConverter", "hf_to_dcp")]._actions}
    dcp_to_hf_flags = {a.option_strings[0] for a in levels[("GenericDCPConverter", "dcp_to_hf")]._actions}
    assert {"--hf_dir", "--dcp_dir", "--force"} <= hf_to_dcp_flags
    assert {"--load_dir", "--save_dir", "--model_assets_dir", "--max_shard_size", "--force"} <= dcp_to_hf_flags


@pytest.mark.slow  # a fresh interpreter
def test_console_script_reports_errors_without_traceback(tmp_path):
    script = Path(sys.executable).with_name("mm-convert")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mmfsdp.ckpt.cli"]
    proc = subprocess.run([*command, "GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(tmp_path / "missing"),
                           "--dcp_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("mm-convert: error: weights directory") and "Traceback" not in proc.stderr


def _module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are copies of `tensors`, under their dotted names."""
    model = torch.nn.Module()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(value.clone()))
    return model


def test_export_checkpoint_hf_follows_the_kept_checkpoints(tmp_path):
    """`training.save_format: hf`: `<save>/iter_N` exported to `<save>/hf/iter_N`; exports of pruned iterations go."""
    from mmfsdp.ckpt import HF_EXPORT_DIRNAME, export_checkpoint_hf, list_iterations

    tensors = {k: v for k, v in _toy_tensors().items() if k != "step"}
    assets = _write_hf(tmp_path / "assets", tensors, shards=1)
    model = _module_of(tensors)
    save = tmp_path / "save"
    for iteration in (1, 2, 3):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        save_checkpoint(save, iteration, model=model, keep_last=2)
        out = export_checkpoint_hf(save, iteration, assets)
        assert out == save / HF_EXPORT_DIRNAME / f"iter_{iteration:07d}"
    assert list_iterations(save) == [2, 3]
    assert sorted(p.name for p in (save / HF_EXPORT_DIRNAME).iterdir()) == ["iter_0000002", "iter_0000003"]
    _assert_bit_exact(_read_all(save / HF_EXPORT_DIRNAME / "iter_0000003"), {k: v.clone() for k, v in model.state_dict().items()})
    assert (save / HF_EXPORT_DIRNAME / "iter_0000003" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "assets_generation, recorded, expected",
    [
        pytest.param("{}", [5, 7, 5], {"eos_token_id": [5, 7], "pad_token_id": 0}, id="stops_added"),
        pytest.param('{"eos_token_id": 9, "pad_token_id": 3, "temperature": 0.7}', [5],
                     {"eos_token_id": [5, 9], "pad_token_id": 3, "temperature": 0.7}, id="merged_over_the_assets"),
        pytest.param(None, [5], {"eos_token_id": [5], "pad_token_id": 0}, id="no_assets_file"),
        pytest.param('{"eos_token_id": 9}', None, {"eos_token_id": 9}, id="nothing_recorded"),
    ],
)
def test_exports_name_the_architecture_and_the_recorded_stop_tokens(tmp_path, assets_generation, recorded, expected):
    """`config.json` gets the adapter's `architectures`; `generation_config.json` the stop tokens the checkpoint
    records (`generation_metadata`) before the assets' own, the assets' `pad_token_id` kept; a checkpoint that
    records none keeps the assets' file as it is (`mmfsdp.ckpt.export_config`)."""
    from mmfsdp.ckpt import IdentityAdapter, dcp_to_hf, generation_metadata

    class Generating(IdentityAdapter):
        architectures = ("ToyForCausalLM",)

    tensors = {k: v for k, v in _toy_tensors().items() if k != "step"}
    assets = {name: text for name, text in ASSETS.items() if name != "generation_config.json"}
    if assets_generation is not None:
        assets["generation_config.json"] = assets_generation
    hf = _write_hf(tmp_path / "hf", tensors, shards=1, assets=assets)
    metadata = None if recorded is None else generation_metadata(recorded, pad_token_id=0)
    save_checkpoint(tmp_path / "save", 1, model=_module_of(tensors), metadata=metadata)
    out = dcp_to_hf(tmp_path / "save", tmp_path / "out", hf, adapter=Generating(), progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config == {"architectures": ["ToyForCausalLM"], **json.loads(ASSETS["config.json"])}
    assert json.loads((out / "generation_config.json").read_text()) == expected
    if recorded is None:
        assert (out / "generation_config.json").read_text() == assets_generation  # untouched


def test_exports_add_the_adapters_config_defaults_only_where_absent(tmp_path):
    """`StateDictAdapter.export_config_defaults`: a dotted key the copied `config.json` lacks is written, one it has
    keeps its value, one under a section the config does not have is not invented."""
    from mmfsdp.ckpt import IdentityAdapter, dcp_to_hf

    class Defaults(IdentityAdapter):
        export_config_defaults = (("text_config.norm_topk_prob", True), ("text_config.hidden_act", "gelu"),
                                  ("vision_config.depth", 2))

    tensors = {k: v for k, v in _toy_tensors().items() if k != "step"}
    config = {**json.loads(ASSETS["config.json"]), "text_config": {"hidden_act": "silu"}}
    hf = _write_hf(tmp_path / "hf", tensors, shards=1, assets={**ASSETS, "config.json": json.dumps(config)})
    save_checkpoint(tmp_path / "save", 1, model=_module_of(tensors))
    out = dcp_to_hf(tmp_path / "save", tmp_path / "out", hf, adapter=Defaults(), progress=False)
    written = json.loads((out / "config.json").read_text())
    assert written == {**config, "text_config": {"hidden_act": "silu", "norm_topk_prob": True}}
