"""Reading HF safetensors directories and `load_hf_weights` (single process)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mmfsdp.ckpt import CheckpointError, SafetensorsDir, get_state_dict_adapter, load_hf_weights


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 6)
        self.register_buffer("inv_freq", torch.zeros(2), persistent=False)


def _write_sharded(directory, shards: dict[str, dict[str, torch.Tensor]], index: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for filename, tensors in shards.items():
        save_file(tensors, directory / filename, metadata={"format": "pt"})
        weight_map.update({key: filename for key in tensors})
    if index:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _net_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def test_load_sharded_with_dtype_conversion(tmp_path):
    tensors = _net_tensors()
    _write_sharded(tmp_path, {
        "a.safetensors": {"embed.weight": tensors["embed.weight"].to(torch.bfloat16)},
        "b.safetensors": {"proj.weight": tensors["proj.weight"], "proj.bias": tensors["proj.bias"]},
    })
    model = Net()
    result = load_hf_weights(model, tmp_path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, tensors["embed.weight"].to(torch.bfloat16).float())
    assert torch.equal(model.proj.weight, tensors["proj.weight"]) and torch.equal(model.proj.bias, tensors["proj.bias"])


def test_single_file_and_adapter(tmp_path, toy_adapters):
    tensors = _net_tensors()
    save_file({f"legacy.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    model = torch.nn.Module()
    model.model = Net()
    load_hf_weights(model, tmp_path, adapter=get_state_dict_adapter("toy_prefix"))
    for key, value in tensors.items():
        assert torch.equal(model.model.state_dict()[key], value)


def test_adapter_is_chosen_from_config_model_type(tmp_path, toy_adapters):
    tensors = _net_tensors()
    save_file({f"legacy.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy_prefix"}))
    model = torch.nn.Module()
    model.model = Net()
    load_hf_weights(model, tmp_path)
    assert torch.equal(model.model.proj.weight, tensors["proj.weight"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy_unknown"}))
    with pytest.raises(CheckpointError, match="no state-dict adapter for config.json model_type 'toy_unknown'"):
        load_hf_weights(model, tmp_path)
    load_hf_weights(model, tmp_path, adapter="toy_prefix")  # an explicit model id wins over config.json


def test_mismatches_are_listed(tmp_path):
    tensors = _net_tensors()
    save_file({"embed.weight": torch.zeros(11, 4), "proj.weight": tensors["proj.weight"], "extra.weight": torch.zeros(1)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"(?s)embed.weight: model \(10, 4\), file \(11, 4\).*proj.bias.*extra.weight"):
        load_hf_weights(Net(), tmp_path)
    save_file({k: v for k, v in tensors.items() if k != "proj.bias"} | {"extra.weight": torch.zeros(1)},
              tmp_path / "model.safetensors")
    model = Net()
    result = load_hf_weights(model, tmp_path, strict=False)
    assert result.missing_keys == ["proj.bias"] and result.unexpected_keys == ["extra.weight"]
    assert torch.equal(model.proj.weight, tensors["proj.weight"])


def test_tied_weights_count_as_present(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    weight = torch.randn(5, 3)
    save_file({"embed.weight": weight}, tmp_path / "model.safetensors")
    model = Tied()
    assert load_hf_weights(model, tmp_path).missing_keys == []
    assert torch.equal(model.head.weight, weight)


def test_meta_model_must_be_materialised(tmp_path):
    save_file(_net_tensors(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Net()
    with pytest.raises(CheckpointError, match="meta device.*to_empty"):
        load_hf_weights(model, tmp_path)
    model.to_empty(device="cpu")
    load_hf_weights(model, tmp_path)
    assert torch.equal(model.proj.weight, _net_tensors()["proj.weight"])


def test_directory_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsDir(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        SafetensorsDir(tmp_path / "file.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        SafetensorsDir(empty)

    tensors = _net_tensors()
    no_index = tmp_path / "no_index"
    _write_sharded(no_index, {"a.safetensors": {"embed.weight": tensors["embed.weight"]},
                              "b.safetensors": {"proj.bias": tensors["proj.bias"]}}, index=False)
    with pytest.raises(CheckpointError, match="2 safetensors files but no model.safetensors.index.json"):
        SafetensorsDir(no_index)

    lost_shard = tmp_path / "lost_shard"
    _write_sharded(lost_shard, {"a.safetensors": {"embed.weight": tensors["embed.weight"]},
                                "b.safetensors": {"proj.bias": tensors["proj.bias"]}})
    (lost_shard / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files that are missing: b.safetensors"):
        SafetensorsDir(lost_shard)

    stale_index = tmp_path / "stale_index"
    _write_sharded(stale_index, {"a.safetensors": {"embed.weight": tensors["embed.weight"]}})
    index = json.loads((stale_index / "model.safetensors.index.json").read_text())
    index["weight_map"]["proj.bias"] = "a.safetensors"
    (stale_index / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="keys listed in the index are not in the named shard: proj.bias"):
        SafetensorsDir(stale_index)

    (stale_index / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not a safetensors index"):
        SafetensorsDir(stale_index)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        SafetensorsDir(corrupt)
