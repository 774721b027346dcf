"""State-dict adapters: renames, many-to-one (stacked experts) through the streaming converter, entry points.

The toy adapters (`ckpt_toy_adapters.py`) are installed as a real distribution by the `toy_adapters` fixture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from mmfsdp.ckpt import (
    IDENTITY,
    CheckpointError,
    FromHF,
    RenameAdapter,
    SafetensorsDir,
    StateDictAdapter,
    ToHF,
    find_state_dict_adapter,
    get_state_dict_adapter,
    load_checkpoint,
    load_hf_weights,
    registered_adapter_ids,
    save_checkpoint,
)
from mmfsdp.ckpt.adapters import plan_from_hf, plan_to_hf
from mmfsdp.ckpt.cli import main
from mmfsdp.ckpt.dcp_io import read_dcp_metadata, tensor_entries

NUM_EXPERTS = 3
SRC = Path(__file__).parents[1] / "src" / "mmfsdp" / "ckpt"


def _convert(*argv) -> int:
    return main(["GenericDCPConverter", *map(str, argv)])


class Prefixes(RenameAdapter):
    renames = (("old.head.", "head."), ("old.", "model."))


def test_rename_adapter_maps_prefixes_both_ways_and_as_a_key_mapping():
    adapter = Prefixes()
    pairs = {"old.layers.0.w": "model.layers.0.w", "old.head.w": "head.w", "other.w": "other.w", "model.x": "model.x"}
    assert {key: adapter.model_key(key) for key in pairs} == pairs
    assert adapter.hf_key("model.layers.0.w") == "old.layers.0.w" and adapter.hf_key("head.w") == "old.head.w"
    mapping = adapter.key_mapping()
    assert mapping == {r"^old\.head\.": "head.", r"^old\.": "model."}

    def apply(key: str) -> str:  # what transformers does with key_mapping: the first matching pattern applies
        for pattern, replacement in mapping.items():
            if re.search(pattern, key):
                return re.sub(pattern, replacement, key)
        return key

    assert {key: apply(key) for key in pairs} == pairs
    assert IDENTITY.key_mapping() == {} and StateDictAdapter().key_mapping() is None
    with pytest.raises(CheckpointError, match="file keys old.a and model.a both map to model.a"):
        adapter.from_hf({"old.a": (1,), "model.a": (1,)})


def test_plans_are_checked_and_shaped_on_meta():
    with pytest.raises(ValueError, match="exactly one HF key"):
        FromHF(("a", "b"))
    with pytest.raises(ValueError, match="exactly one HF key"):
        ToHF(("a", "b"))

    class Sloppy(StateDictAdapter):
        model_id = "sloppy"

        def __init__(self, plans: dict[str, FromHF]) -> None:
            self.plans = plans

        def from_hf(self, hf_shapes):
            return self.plans

    specs = {"a": ((2, 3), torch.float32), "b": ((2, 3), torch.float32), "c": ((4,), torch.bfloat16)}
    with pytest.raises(
        CheckpointError, match=r"sloppy does not fit these files: asks for .*x \(for m\); leaves file keys unused: b, c"
    ):
        plan_from_hf(Sloppy({"m": FromHF(("a", "x"), torch.stack)}), specs)
    with pytest.raises(CheckpointError, match="file key a feeds both m and n"):
        plan_from_hf(Sloppy({"m": FromHF(("a",)), "n": FromHF(("a", "b"), torch.stack)}), specs)
    with pytest.raises(CheckpointError, match="cannot make m from a, c"):
        plan_from_hf(Sloppy({"m": FromHF(("a", "c"), torch.stack), "b": FromHF(("b",))}), specs)
    plans = plan_from_hf(Sloppy({"m": FromHF(("a", "b"), torch.stack), "c": FromHF(("c",))}), specs)
    assert (plans["m"].shape, plans["m"].dtype, plans["c"].shape, plans["c"].dtype) == (
        (2, 2, 3),
        torch.float32,
        (4,),
        torch.bfloat16,
    )

    planned = plan_to_hf(IDENTITY, {"m": ((2, 3), torch.float32)})
    assert planned["m"].specs == {"m": ((2, 3), torch.float32)}


def _moe_files() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"embed_tokens.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16)}
    for layer in range(2):
        for expert in range(NUM_EXPERTS):
            tensors[f"layers.{layer}.mlp.experts.{expert}.down.weight"] = torch.randn(8, 6, generator=gen)
            tensors[f"layers.{layer}.mlp.experts.{expert}.bias"] = torch.randn(6, generator=gen).to(torch.bfloat16)
        tensors[f"layers.{layer}.mlp.gate.weight"] = torch.randn(5, 8, generator=gen)
        tensors[f"layers.{layer}.mlp.up.weight"] = torch.randn(5, 8, generator=gen)
        tensors[f"layers.{layer}.norm.weight"] = torch.rand(8, generator=gen)
    return tensors


def _model_view(files: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the toy_moe model's state_dict holds for `files`, written out by hand."""
    out = {"embed_tokens.weight": files["embed_tokens.weight"]}
    for layer in range(2):
        stem = f"layers.{layer}.mlp"
        for leaf in ("down.weight", "bias"):
            out[f"{stem}.experts.{leaf}"] = torch.stack(
                [files[f"{stem}.experts.{e}.{leaf}"] for e in range(NUM_EXPERTS)]
            )
        out[f"{stem}.gate_up.weight"] = torch.cat([files[f"{stem}.gate.weight"], files[f"{stem}.up.weight"]], dim=1)
        out[f"layers.{layer}.norm.weight"] = files[f"layers.{layer}.norm.weight"]
    return out


class MoENet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8, dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = torch.nn.Module()
            layer.mlp.experts.down = torch.nn.Module()
            layer.mlp.experts.down.weight = torch.nn.Parameter(torch.zeros(NUM_EXPERTS, 8, 6))
            layer.mlp.experts.bias = torch.nn.Parameter(torch.zeros(NUM_EXPERTS, 6, dtype=torch.bfloat16))
            layer.mlp.gate_up = torch.nn.Linear(16, 5, bias=False)
            layer.norm = torch.nn.Module()
            layer.norm.weight = torch.nn.Parameter(torch.zeros(8))


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 3) -> Path:
    directory.mkdir(parents=True)
    names, weight_map = list(tensors), {}
    for index in range(shards):
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names[index::shards]}, directory / filename)
        weight_map.update({name: filename for name in names[index::shards]})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


def _assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key


def test_many_to_one_round_trip_through_the_streaming_converter(tmp_path, toy_adapters):
    files = _moe_files()
    expected = _model_view(files)
    hf = _write(
        tmp_path / "hf", files, {"model_type": "toy_moe", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2}
    )

    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 0  # adapter from model_type
    release = tmp_path / "dcp" / "release"
    entries = tensor_entries(read_dcp_metadata(release), "model.")
    assert {name: (tuple(e.size), e.properties.dtype) for name, e in entries.items()} == {
        name: (tuple(t.shape), t.dtype) for name, t in expected.items()
    }
    model = MoENet()
    assert load_checkpoint(tmp_path / "dcp", model=model).iteration == "release"
    _assert_bit_exact(dict(model.state_dict()), expected)

    # back to one tensor per expert: small shards, each model tensor's pieces in one shard
    assert (
        _convert(
            "dcp_to_hf",
            "--load_dir",
            tmp_path / "dcp",
            "--save_dir",
            tmp_path / "out",
            "--model_assets_dir",
            hf,
            "--max_shard_size",
            "300B",
        )
        == 0
    )
    _assert_bit_exact(_read_all(tmp_path / "out"), files)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in files.values())
    shard_of = index["weight_map"]
    assert len({shard_of[f"layers.0.mlp.experts.{e}.down.weight"] for e in range(NUM_EXPERTS)}) == 1

    # explicit model id; and a training checkpoint (one packed file per rank, loaded through dcp.load) splits too
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp2", "--model_id", "toy_moe") == 0
    assert (
        _convert(
            "dcp_to_hf",
            "--load_dir",
            tmp_path / "dcp2",
            "--save_dir",
            tmp_path / "out2",
            "--model_assets_dir",
            hf,
            "--model_id",
            "toy_moe",
        )
        == 0
    )
    _assert_bit_exact(_read_all(tmp_path / "out2"), files)
    save_checkpoint(tmp_path / "train", 1, model=model)
    assert (
        _convert(
            "dcp_to_hf", "--load_dir", tmp_path / "train", "--save_dir", tmp_path / "out3", "--model_assets_dir", hf
        )
        == 0
    )
    _assert_bit_exact(_read_all(tmp_path / "out3"), files)

    # the HF loader uses the same adapter
    fresh = MoENet()
    assert load_hf_weights(fresh, hf) == ([], [])
    _assert_bit_exact(dict(fresh.state_dict()), expected)


def test_discovery_by_model_id_and_model_type(toy_adapters):
    ids = registered_adapter_ids()
    assert ids[0] == "identity" and {"toy_moe", "toy_prefix"} <= set(ids)
    assert type(get_state_dict_adapter("toy_moe")).__name__ == "ToyMoEAdapter"
    assert type(find_state_dict_adapter({"model_type": "toy_prefix"})).__name__ == "ToyPrefixAdapter"
    assert find_state_dict_adapter({}) is IDENTITY and find_state_dict_adapter(None) is IDENTITY
    assert get_state_dict_adapter("identity") is IDENTITY
    with pytest.raises(
        CheckpointError,
        match=r"no state-dict adapter for model id 'toy_mo' \(did you mean 'toy_moe'\?\); "
        r"registered: identity, .*toy_moe.*entry-point group mmfsdp.state_dict_adapters",
    ):
        get_state_dict_adapter("toy_mo")
    with pytest.raises(
        CheckpointError,
        match=r"model_type 'toy_other'; registered: identity \(any names as they are\), .*"
        r"toy_moe \(model_type toy_moe\), toy_prefix \(model_type toy_prefix\)",
    ):
        find_state_dict_adapter({"model_type": "toy_other"})


def test_broken_entry_point_is_a_clear_error(tmp_path, toy_adapters):
    info = toy_adapters / "ckpt_toy_adapters-0.1.dist-info" / "entry_points.txt"
    info.write_text(info.read_text() + "toy_broken = ckpt_toy_adapters:NoSuchAdapter\ntoy_wrong = json:dumps\n")
    with pytest.raises(
        CheckpointError, match="'toy_broken' = ckpt_toy_adapters:NoSuchAdapter .* does not load: AttributeError"
    ):
        get_state_dict_adapter("toy_broken")
    with pytest.raises(CheckpointError, match="'toy_wrong' = json:dumps .* is a function, not a StateDictAdapter"):
        get_state_dict_adapter("toy_wrong")


def test_unknown_model_type_is_refused_by_the_cli(tmp_path, toy_adapters, capsys):
    files = {"embed_tokens.weight": torch.randn(16, 8), "norm.weight": torch.ones(8)}
    hf = _write(tmp_path / "hf", files, {"model_type": "toy_unregistered"}, shards=1)
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 2
    err = capsys.readouterr().err
    assert err.startswith("mm-convert: error: no state-dict adapter for config.json model_type 'toy_unregistered'")
    assert "registered: identity" in err and "toy_moe (model_type toy_moe)" in err and "--model_id" in err
    assert not (tmp_path / "dcp").exists()
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp", "--model_id", "identity") == 0
    assert (
        _convert("dcp_to_hf", "--load_dir", tmp_path / "dcp", "--save_dir", tmp_path / "out", "--model_assets_dir", hf)
        == 2
    )
    assert "model_type 'toy_unregistered'" in capsys.readouterr().err
    assert (
        _convert(
            "dcp_to_hf",
            "--load_dir",
            tmp_path / "dcp",
            "--save_dir",
            tmp_path / "out",
            "--model_assets_dir",
            hf,
            "--key_map",
            "identity",
        )
        == 0
    )
    _assert_bit_exact(_read_all(tmp_path / "out"), files)
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "d2", "--model_id", "nope") == 2
    assert "no state-dict adapter for model id 'nope'" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter
def test_console_script_finds_entry_points_in_a_fresh_process(tmp_path, toy_adapters):
    hf = _write(tmp_path / "hf", _moe_files(), {"model_type": "toy_moe"})
    script = Path(sys.executable).with_name("mm-convert")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mmfsdp.ckpt.cli"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.fspath(toy_adapters), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [*command, "GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(hf), "--dcp_dir", str(tmp_path / "dcp")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layers.0.mlp.experts.down.weight" in tensor_entries(
        read_dcp_metadata(tmp_path / "dcp" / "release"), "model."
    )


@pytest.mark.slow  # a fresh interpreter
def test_ckpt_names_no_model_family_and_imports_no_model_package():
    code = (
        "import sys, mmfsdp.ckpt, mmfsdp.ckpt.convert, mmfsdp.ckpt.cli; "
        "print([m for m in sys.modules if m.startswith(('mmfsdp.model', 'transformers'))])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    families = re.compile(r"mistral|qwen|pixtral|llava|llama|gemma", re.IGNORECASE)
    hits = [
        f"{path.name}:{n}"
        for path in SRC.glob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if families.search(line)
    ]
    assert hits == []


def run_load_stacked_into_shards(rank: int, world_size: int, hf_dir: str, plugin_dir: str) -> dict:
    sys.path.insert(0, plugin_dir)
    model = MoENet()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    load_hf_weights(model, hf_dir)
    local = model.layers[0].mlp.experts.down.weight.to_local().shape[0]
    return {"local_experts": local, "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def test_stacked_tensors_load_into_fsdp2_shards(tmp_path, toy_adapters, run_ranks):
    files = _moe_files()
    hf = _write(tmp_path / "hf", files, {"model_type": "toy_moe"})
    results = run_ranks(run_load_stacked_into_shards, 2, str(hf), str(toy_adapters))
    assert [r["local_experts"] for r in results] == [2, 1]
    for result in results:
        _assert_bit_exact(result["state"], _model_view(files))
