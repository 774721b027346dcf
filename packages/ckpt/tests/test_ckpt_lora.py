"""Trainable-only checkpoints, `key_map` loading and the LoRA exports, on a hand-built model with PEFT's names.

`ToyLora` has the layout PEFT's injection gives a model: a wrapped layer `proj` holding `proj.base_layer`
(frozen) and `proj.lora_A.default` / `proj.lora_B.default` (trained), next to an unwrapped frozen `head`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mmfsdp.ckpt import (
    CheckpointError,
    dcp_to_hf,
    load_checkpoint,
    load_hf_weights,
    read_checkpoint_info,
    save_checkpoint,
)
from mmfsdp.ckpt.cli import main as mm_convert
from mmfsdp.ckpt.lora import (
    PEFT_CONFIG_FILENAME,
    PEFT_WEIGHTS_FILENAME,
    PeftFileAdapter,
    dcp_to_merged_hf,
    dcp_to_peft,
    stored_key,
)

R, ALPHA = 2, 6.0


class ToyLoraLayer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, R, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(R, d_out, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + ALPHA / R * self.lora_B["default"](self.lora_A["default"](x))


class ToyLora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = ToyLoraLayer(6, 5)
        self.head = nn.Linear(5, 3, bias=False)
        for name, param in self.named_parameters():
            param.requires_grad_("lora_" in name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)))


def _base_files(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF-style directory of the base (no model_type: identity names) and its tensors."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "proj.weight": torch.randn(5, 6, generator=gen),
        "proj.bias": torch.randn(5, generator=gen),
        "head.weight": torch.randn(3, 5, generator=gen),
    }
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text('{"model": "toy"}')
    return tensors


def _trained(tmp_path, steps: int = 3):
    torch.manual_seed(0)
    model = ToyLora()
    base = _base_files(tmp_path / "base")
    result = load_hf_weights(model, tmp_path / "base", key_map=stored_key)
    assert result.missing_keys == [] and result.unexpected_keys == []
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, base


def _save(model, optimizer, save_dir, iteration=3):
    lora = {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": ["proj"]}
    save_checkpoint(save_dir, iteration, model=model, optimizer=optimizer, trainable_only=True, metadata={"lora": lora})


def test_stored_key_maps_the_base_layer_and_leaves_adapters_out():
    assert stored_key("a.q_proj.base_layer.weight") == "a.q_proj.weight"
    assert stored_key("a.q_proj.base_layer.bias") == "a.q_proj.bias"
    assert stored_key("a.q_proj.lora_A.default.weight") is None
    assert stored_key("a.q_proj.lora_B.default.weight") is None
    assert stored_key("lm_head.weight") == "lm_head.weight"


def test_trainable_only_checkpoint_holds_adapters_and_optimizer_and_resumes_them(tmp_path):
    model, optimizer, base = _trained(tmp_path)
    _save(model, optimizer, tmp_path / "ckpt")
    info = read_checkpoint_info(tmp_path / "ckpt" / "iter_0000003")
    assert info["trainable_only"] is True and info["metadata"]["lora"]["r"] == R

    fresh = ToyLora()
    load_hf_weights(fresh, tmp_path / "base", key_map=stored_key)
    frozen_before = {k: v.clone() for k, v in fresh.state_dict().items() if "lora_" not in k}
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
        if key in frozen_before:
            assert torch.equal(value, frozen_before[key]), f"{key}: a frozen tensor was loaded from the checkpoint"
    assert torch.equal(fresh.proj.base_layer.weight, base["proj.weight"])
    # the optimizer moments came back: one more identical step
    x = torch.randn(4, 6)
    for m, opt in ((model, optimizer), (fresh, fresh_opt)):
        m(x).square().mean().backward()
        opt.step()
    assert torch.equal(fresh.proj.lora_B["default"].weight, model.proj.lora_B["default"].weight)

    full = tmp_path / "full"
    save_checkpoint(full, 3, model=model, optimizer=optimizer)
    assert read_checkpoint_info(full / "iter_0000003")["trainable_only"] is False


def test_trainable_only_checkpoint_into_a_model_without_those_parameters_names_the_cause(tmp_path):
    model, optimizer, _ = _trained(tmp_path)
    _save(model, optimizer, tmp_path / "ckpt")
    other = ToyLora()
    other.head.weight.requires_grad_(True)  # trains a parameter the checkpoint does not hold
    with pytest.raises(CheckpointError, match="only the trainable parameters"):
        load_checkpoint(tmp_path / "ckpt", model=other, optimizer=None, load_optim=False)


def test_key_map_loads_a_whole_model_checkpoint_into_the_base_layers(tmp_path):
    """A full checkpoint of the plain model (as a `release`) fills a LoRA model's base through `stored_key`."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 5)
            self.head = nn.Linear(5, 3, bias=False)

    plain = Plain()
    save_checkpoint(tmp_path / "plain", 1, model=plain)
    model = ToyLora()
    adapter_before = model.proj.lora_A["default"].weight.clone()
    load_checkpoint(tmp_path / "plain", model=model, key_map=stored_key, load_rng=False)
    assert torch.equal(model.proj.base_layer.weight, plain.proj.weight)
    assert torch.equal(model.proj.base_layer.bias, plain.proj.bias)
    assert torch.equal(model.head.weight, plain.head.weight)
    assert torch.equal(model.proj.lora_A["default"].weight, adapter_before)


def test_peft_export_loads_back_and_merged_export_equals_the_model(tmp_path):
    model, optimizer, base = _trained(tmp_path)
    _save(model, optimizer, tmp_path / "ckpt")

    assert (
        mm_convert(
            [
                "LoraConverter",
                "dcp_to_peft",
                "--load_dir",
                str(tmp_path / "ckpt"),
                "--save_dir",
                str(tmp_path / "peft"),
                "--base_model_name_or_path",
                "toy/base",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG_FILENAME).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == (
        "LORA",
        R,
        ALPHA,
        ["proj"],
    )
    with safe_open(tmp_path / "peft" / PEFT_WEIGHTS_FILENAME, "pt") as f:
        assert sorted(f.keys()) == ["base_model.model.proj.lora_A.weight", "base_model.model.proj.lora_B.weight"]
        assert torch.equal(f.get_tensor("base_model.model.proj.lora_B.weight"), model.proj.lora_B["default"].weight)
    reloaded = ToyLora()
    load_hf_weights(reloaded, tmp_path / "base", key_map=stored_key)
    load_hf_weights(
        reloaded, tmp_path / "peft", adapter=PeftFileAdapter(), key_map=lambda k: k if "lora_" in k else None
    )
    x = torch.randn(7, 6)
    with torch.no_grad():
        assert torch.equal(reloaded(x), model(x))

    assert (
        mm_convert(
            [
                "LoraConverter",
                "dcp_to_merged_hf",
                "--load_dir",
                str(tmp_path / "ckpt"),
                "--save_dir",
                str(tmp_path / "merged"),
                "--model_assets_dir",
                str(tmp_path / "base"),
            ]
        )
        == 0
    )
    assert (tmp_path / "merged" / "tokenizer.json").read_text() == '{"model": "toy"}'
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f:
        merged = {key: f.get_tensor(key) for key in f.keys()}
    assert merged.keys() == base.keys()
    assert torch.equal(merged["head.weight"], base["head.weight"])
    assert torch.equal(merged["proj.bias"], base["proj.bias"])
    plain = nn.Linear(6, 5)
    plain.load_state_dict({"weight": merged["proj.weight"], "bias": merged["proj.bias"]})
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model.proj(x), rtol=1e-6, atol=1e-6)


def test_exports_refuse_the_wrong_kind_of_checkpoint(tmp_path):
    model, optimizer, _ = _trained(tmp_path)
    _save(model, optimizer, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="LoraConverter"):
        dcp_to_hf(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "base")
    save_checkpoint(tmp_path / "full", 1, model=model)
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint"):
        dcp_to_peft(tmp_path / "full", tmp_path / "peft")
    with pytest.raises(CheckpointError, match="inside --load_dir"):
        dcp_to_merged_hf(tmp_path / "ckpt", tmp_path / "ckpt" / "out", tmp_path / "base")
