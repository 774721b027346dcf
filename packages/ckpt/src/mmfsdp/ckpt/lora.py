"""LoRA adapters on disk: the names of a PEFT-wrapped layer's tensors, and the exports of an adapter-only
training checkpoint as a PEFT adapter directory or as full HF weights with the adapters merged in.

PEFT's injection (`mmfsdp.model.lora`) replaces each target `nn.Linear` `x` by a LoRA layer that keeps the
original layer as `x.base_layer` and adds `x.lora_A.<adapter>` (`[r, in]`) and `x.lora_B.<adapter>`
(`[out, r]`); the layer computes `base(h) + (alpha / r) · B(A(dropout(h)))`. Weights files (HF safetensors,
a DCP `release`) hold the base layer under its own name, so:

| weights files               | the LoRA model's `state_dict()`                          |
| --------------------------- | -------------------------------------------------------- |
| `x.weight`, `x.bias`        | `x.base_layer.weight`, `x.base_layer.bias`               |
| —                           | `x.lora_A.default.weight`, `x.lora_B.default.weight`     |

`stored_key` is that table, in one place: the `key_map` that `load_hf_weights` and `load_checkpoint` take
to fill the base of a LoRA model and leave its adapters alone.

A LoRA training checkpoint is trainable-only (`checkpoint.json`: `"trainable_only": true`: adapters,
optimizer, no base) and carries the adapter settings in its metadata under "lora":
`{"r": int, "alpha": float, "dropout": float, "target_modules": [module names]}`.

`dcp_to_peft` writes `adapter_model.safetensors` with PEFT's names (`base_model.model.<x>.lora_A.weight`:
the module names of the transformers-5 model, the adapter name left out — what `PeftModel.save_pretrained`
writes and `PeftModel.from_pretrained(base, dir)` loads) in fp32 as trained, and `adapter_config.json`
(`target_modules`: the full names of the wrapped modules). `dcp_to_merged_hf` reads the base HF weights of
`--model_assets_dir` one tensor at a time, asks the family's state-dict adapter which model tensor each file
tensor is, adds `(alpha / r) · B · A` (in fp32, stored in the base's dtype) to every target's weight, and
writes the same files with the same names, layout and dtypes, plus the other files of the directory (their
`config.json` and `generation_config.json` completed for servers: `mmfsdp.ckpt.export_config`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, plan_from_hf, resolve_state_dict_adapter
from mmfsdp.ckpt.state_files import MODEL_PREFIX, read_checkpoint_info
from mmfsdp.ckpt.dcp_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    quiet_single_process,
    read_dcp_metadata,
    tensor_entries,
)
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.export_config import write_export_config
from mmfsdp.ckpt.hf import INDEX_FILENAME, SafetensorsDir, SafetensorsWriter, read_config
from mmfsdp.ckpt.layout import resolve_checkpoint
from mmfsdp.ckpt.outputs import copy_model_assets, discard_output_dir, prepare_output_dir, publish_output_dir

__all__ = [
    "ADAPTER_NAME",
    "LORA_METADATA",
    "PEFT_CONFIG_FILENAME",
    "PEFT_WEIGHTS_FILENAME",
    "PeftFileAdapter",
    "stored_key",
    "is_adapter_key",
    "adapter_keys",
    "read_peft_config",
    "dcp_to_peft",
    "dcp_to_merged_hf",
]

ADAPTER_NAME = "default"
"""The PEFT adapter name of every LoRA layer here (the one PEFT uses when none is given)."""
LORA_METADATA = "lora"
"""The key of the adapter settings in a checkpoint's metadata (`checkpoint.json`)."""
PEFT_CONFIG_FILENAME = "adapter_config.json"
PEFT_WEIGHTS_FILENAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer."
_ADAPTER_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
_PEFT_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def is_adapter_key(key: str) -> bool:
    """Whether `state_dict()` key `key` is a LoRA adapter weight (`x.lora_A.<adapter>.weight`, `x.lora_B...`)."""
    return _ADAPTER_RE.match(key) is not None


def stored_key(key: str) -> str | None:
    """The name weights files give the LoRA model's `state_dict()` key `key`: `x.base_layer.w` -> `x.w`; None for
    an adapter weight, which no base weights file holds."""
    if is_adapter_key(key):
        return None
    return key.replace(_BASE_LAYER, ".")


def adapter_keys(module: str, adapter: str = ADAPTER_NAME) -> tuple[str, str]:
    """The `state_dict()` keys of LoRA layer `module`'s A and B weights."""
    return f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight"


class PeftFileAdapter(StateDictAdapter):
    """`adapter_model.safetensors` names (`base_model.model.x.lora_A.weight`) <-> `state_dict()` names
    (`x.lora_A.default.weight`): for `load_hf_weights` of a PEFT adapter directory into a LoRA model."""

    model_id = "peft_lora"

    def from_hf(self, hf_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FromHF]:
        plans = {}
        for key in hf_shapes:
            match = _PEFT_RE.match(key)
            if match is None:
                raise CheckpointError(
                    f"{key} is not a LoRA weight of a PEFT adapter (base_model.model.<module>.lora_A/B.weight); "
                    "only plain LoRA adapters load here (no modules_to_save, DoRA or other PEFT methods)"
                )
            plans[adapter_keys(match["module"])[match["which"] == "B"]] = FromHF((key,))
        return plans


def read_peft_config(path: str | os.PathLike) -> dict:
    """`adapter_config.json` of PEFT adapter directory `path`, checked to be a plain LoRA adapter."""
    path = Path(path)
    config_path, weights_path = path / PEFT_CONFIG_FILENAME, path / PEFT_WEIGHTS_FILENAME
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(
            f"{path} is not a PEFT adapter directory: it needs {PEFT_CONFIG_FILENAME} and {PEFT_WEIGHTS_FILENAME}"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise CheckpointError(f"{config_path} is not a plain LoRA adapter (peft_type LORA, no DoRA, no rsLoRA)")
    return config


def _lora_info(path: Path) -> dict:
    info = read_checkpoint_info(path)
    lora = (info.get("metadata") or {}).get(LORA_METADATA)
    if not info.get("trainable_only") or not isinstance(lora, dict):
        raise CheckpointError(
            f"{path} is not a LoRA checkpoint (no adapter settings in its checkpoint.json); "
            "export a full checkpoint with `mm-convert GenericDCPConverter dcp_to_hf`"
        )
    return lora


def _load_adapters(path: Path, lora: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B) of every adapter in the checkpoint, whole, on the CPU."""
    entries = {
        name: entry
        for name, entry in tensor_entries(read_dcp_metadata(path), MODEL_PREFIX).items()
        if is_adapter_key(name)
    }
    tensors = {name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for name, entry in entries.items()}
    if tensors:
        with quiet_single_process():
            dcp.load(
                {"model": tensors},
                storage_reader=SafeFileSystemReader(os.fspath(path)),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _ADAPTER_RE.match(name)
        layers.setdefault(match["module"], {})[match["which"]] = tensor
    targets = list(lora.get("target_modules", []))
    incomplete = [m for m, pair in layers.items() if set(pair) != {"A", "B"}]
    if sorted(layers) != sorted(targets) or incomplete:
        missing = sorted(set(targets) - set(layers))
        raise CheckpointError(
            f"{path}: the adapters stored ({len(layers)} layers) do not match the target modules of its metadata "
            f"({len(targets)}; missing {missing[:5]}, incomplete {incomplete[:5]}); the checkpoint is damaged"
        )
    return {module: (pair["A"], pair["B"]) for module, pair in layers.items()}


def _scale(lora: dict) -> float:
    return float(lora["alpha"]) / int(lora["r"])


def dcp_to_peft(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    force: bool = False,
) -> Path:
    """Write the adapters of LoRA checkpoint `load_dir` (tracker, `iter_*`) as a PEFT adapter directory."""
    path, _ = resolve_checkpoint(load_dir)
    lora = _lora_info(path)
    adapters = _load_adapters(path, lora)
    save_dir = Path(save_dir)
    tmp_dir = prepare_output_dir(save_dir, force, "--save_dir", [(load_dir, "--load_dir")])
    try:
        tensors = {}
        for module, (a, b) in adapters.items():
            tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
            tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
        save_file(tensors, tmp_dir / PEFT_WEIGHTS_FILENAME, metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_model_name_or_path,
            "r": int(lora["r"]),
            "lora_alpha": float(lora["alpha"]),
            "lora_dropout": float(lora.get("dropout", 0.0)),
            "target_modules": sorted(adapters),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
        }
        (tmp_dir / PEFT_CONFIG_FILENAME).write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        discard_output_dir(tmp_dir)
        raise
    return publish_output_dir(tmp_dir, save_dir)


def _merge_targets(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], weights: SafetensorsDir, adapter: StateDictAdapter
) -> dict[str, str]:
    """HF file key -> the LoRA module whose weight it is, for every adapted module."""
    plans = plan_from_hf(adapter, {key: (info.shape, info.dtype) for key, info in weights.tensors.items()})
    targets = {}
    for module, (a, b) in adapters.items():
        plan = plans.get(f"{module}.weight")
        if plan is None:
            raise CheckpointError(
                f"the base weights in {weights.path} have no {module}.weight (state-dict adapter {adapter.name}); "
                "pass the --model_assets_dir of the model the adapters were trained on"
            )
        if plan.source.combine is not None:
            raise CheckpointError(
                f"{module}.weight is combined from several file tensors; LoRA cannot be merged into it"
            )
        if plan.shape != (b.shape[0], a.shape[1]):
            raise CheckpointError(
                f"{module}: base weight {plan.shape}, adapters A {tuple(a.shape)} and B {tuple(b.shape)}"
            )
        targets[plan.source.hf_keys[0]] = module
    return targets


def dcp_to_merged_hf(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    model_assets_dir: str | os.PathLike,
    *,
    adapter: StateDictAdapter | str | None = None,
    force: bool = False,
) -> Path:
    """Merge the adapters of LoRA checkpoint `load_dir` into the base HF weights of `model_assets_dir` and write
    the result as an HF directory (same shards, names and dtypes; config, tokenizer, ... copied)."""
    path, _ = resolve_checkpoint(load_dir)
    lora = _lora_info(path)
    adapters = _load_adapters(path, lora)
    assets = Path(model_assets_dir)
    weights = SafetensorsDir(assets)
    family = resolve_state_dict_adapter(None if adapter in (None, "auto") else adapter, read_config(assets))
    targets = _merge_targets(adapters, weights, family)
    save_dir = Path(save_dir)
    tmp_dir = prepare_output_dir(save_dir, force, "--save_dir", [(load_dir, "--load_dir"), (model_assets_dir, "--model_assets_dir")])
    scale = _scale(lora)
    try:
        for file in weights.files:
            specs = {key: (info.shape, info.dtype) for key, info in weights.tensors.items() if info.file == file}
            writer = SafetensorsWriter(tmp_dir / file.name, specs, {"format": "pt"})
            try:
                for key in writer.order:
                    tensor = weights.read(key)
                    if key in targets:
                        a, b = adapters[targets[key]]
                        tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
                    writer.write_tensor(key, tensor)
            except BaseException:
                writer.file.close()
                raise
            writer.close()
        if (assets / INDEX_FILENAME).is_file():
            shutil.copy2(assets / INDEX_FILENAME, tmp_dir / INDEX_FILENAME)
        copy_model_assets(assets, tmp_dir)
        write_export_config(tmp_dir, family, read_checkpoint_info(path).get("metadata"))
    except BaseException:
        discard_output_dir(tmp_dir)
        raise
    return publish_output_dir(tmp_dir, save_dir)
