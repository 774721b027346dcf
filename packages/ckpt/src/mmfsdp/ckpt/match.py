"""Does a checkpoint fit a model? Keys and shapes compared from metadata only, never tensor data.

What a run would load is compared with the model it would build, before any
process starts (`apps/train --check`), so a checkpoint of another model is a
list of its differences instead of a failure on every rank minutes later:

1. `expected_shapes(model, ...)`: the names and shapes the loader fills, from
   the model built on the meta device — `get_model_state_dict`, as
   `load_checkpoint` reads it (only the trainable parameters and the buffers for
   an adapter-only checkpoint; stored names through a `key_map`, e.g. the base
   of a LoRA model), and the groups of tied names.
2. The checkpoint's side:
   - DCP (`dcp_shapes`): the `model.*` entries of `.metadata` (read with the
     safe unpickler; it holds keys, global shapes and chunk offsets, no data).
     Entries under `optimizer.` and others are not the model's and are ignored.
     Sharded saves (FSDP2, expert parallel) store global shapes, so the
     unsharded meta model is the right reference for any layout.
   - HF safetensors (`hf_shapes`): the headers of every file (sharded with
     `model.safetensors.index.json` or not) through the family's state-dict
     adapter (`plan_from_hf`: renames, transposed or stacked expert tensors),
     giving the model key and shape each file tensor becomes.
3. `compare_shapes`: missing keys (a tied group counts as present when one of
   its names is stored), unexpected keys and shape mismatches, each a list, so a
   caller prints them one per line (`KeyReport.lines`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from mmfsdp.ckpt.adapters import StateDictAdapter, plan_from_hf, resolve_state_dict_adapter
from mmfsdp.ckpt.dcp_io import read_dcp_metadata, tensor_entries
from mmfsdp.ckpt.hf import SafetensorsDir
from mmfsdp.ckpt.state_files import MODEL_PREFIX, KeyMap

__all__ = ["KeyReport", "expected_shapes", "dcp_shapes", "hf_shapes", "compare_shapes", "check_dcp", "check_hf"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KeyReport:
    """How a checkpoint's model tensors differ from a model's: each list in the model's key order, then the file's."""

    missing: list[str] = field(default_factory=list)
    """Keys the model has and the checkpoint does not."""
    unexpected: list[str] = field(default_factory=list)
    """Keys the checkpoint has and the model does not (for HF files: the file keys)."""
    mismatched: list[tuple[str, Shape, Shape]] = field(default_factory=list)
    """(key, model shape, checkpoint shape) for keys both have."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def counts(self) -> str:
        """`2 missing, 1 unexpected, 3 shape mismatches` (the non-zero parts)."""
        parts = [(len(self.missing), "missing"), (len(self.unexpected), "unexpected"),
                 (len(self.mismatched), "shape mismatch" if len(self.mismatched) == 1 else "shape mismatches")]
        return ", ".join(f"{num} {what}" for num, what in parts if num)

    def lines(self, limit: int = 20) -> list[str]:
        """One line per problem, at most `limit`, then one saying how many more there are."""
        all_lines = [f"missing key {key} (in the model, not in the checkpoint)" for key in self.missing]
        all_lines += [f"unexpected key {key} (in the checkpoint, not in the model)" for key in self.unexpected]
        all_lines += [f"{key}: shape {model} in the model, {stored} in the checkpoint"
                      for key, model, stored in self.mismatched]
        if len(all_lines) > limit:
            return all_lines[:limit] + [f"... and {len(all_lines) - limit} more ({self.counts()} in all)"]
        return all_lines


def expected_shapes(
    model: torch.nn.Module, *, trainable_only: bool = False, key_map: KeyMap | None = None
) -> tuple[dict[str, Shape], list[list[str]]]:
    """The stored name and shape of every tensor a load of `model` fills, and the groups of tied names.

    `model` may be on the meta device. `trainable_only`: an adapter-only checkpoint (frozen parameters left
    out, as `get_state_dict(ignore_frozen_params=True)` saves it). `key_map(model key) -> stored key | None`
    as for `load_checkpoint` / `load_hf_weights` (None: not loaded from this checkpoint).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    by_id: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            by_id.setdefault(id(value), []).append(key)
    shapes: dict[str, Shape] = {}
    stored_name: dict[str, str] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        stored = key if key_map is None else key_map(key)
        if stored is not None:
            shapes[stored] = tuple(value.shape)
            stored_name[key] = stored
    aliases = [[stored_name[k] for k in group if k in stored_name] for group in by_id.values() if len(group) > 1]
    return shapes, [group for group in aliases if len(group) > 1]


def dcp_shapes(path: str | os.PathLike) -> dict[str, Shape]:
    """The model tensors of DCP checkpoint directory `path` (`iter_*` / `release`): state-dict key -> global shape.

    Reads only `.metadata`.
    """
    return {key: tuple(entry.size) for key, entry in tensor_entries(read_dcp_metadata(path), MODEL_PREFIX).items()}


def hf_shapes(
    hf_dir: str | os.PathLike, adapter: StateDictAdapter | str | None = None
) -> tuple[dict[str, Shape], dict[str, tuple[str, ...]], StateDictAdapter]:
    """The model tensors the safetensors of `hf_dir` make: (model key -> shape, model key -> its file keys, adapter).

    Reads only the files' headers (and `config.json`, whose `model_type` picks the adapter when `adapter` is None).
    """
    weights = SafetensorsDir(hf_dir)
    adapter = resolve_state_dict_adapter(adapter, weights.config)
    plans = plan_from_hf(adapter, {key: (info.shape, info.dtype) for key, info in weights.tensors.items()})
    return ({key: plan.shape for key, plan in plans.items()},
            {key: plan.source.hf_keys for key, plan in plans.items()}, adapter)


def compare_shapes(
    expected: Mapping[str, Shape],
    stored: Mapping[str, Shape],
    aliases: Sequence[Sequence[str]] = (),
    stored_names: Mapping[str, Sequence[str]] | None = None,
) -> KeyReport:
    """Missing, unexpected and mismatched keys of `stored` against `expected` (both key -> shape).

    A group of tied names in `aliases` is present when any of its names is stored. `stored_names` gives the
    names to report for an unexpected key (an HF file's own keys); by default the key itself.
    """
    covered = set(stored)
    for group in aliases:
        if covered.intersection(group):
            covered.update(group)
    missing = [key for key in expected if key not in covered]
    unexpected = [name for key in stored if key not in expected
                  for name in (stored_names.get(key, (key,)) if stored_names else (key,))]
    mismatched = [(key, tuple(shape), tuple(stored[key])) for key, shape in expected.items()
                  if key in stored and tuple(stored[key]) != tuple(shape)]
    return KeyReport(missing, unexpected, mismatched)


def check_dcp(
    path: str | os.PathLike, expected: Mapping[str, Shape], aliases: Sequence[Sequence[str]] = ()
) -> KeyReport:
    """`compare_shapes` of the DCP checkpoint `path`'s model tensors against `expected` (metadata only)."""
    return compare_shapes(expected, dcp_shapes(path), aliases)


def check_hf(
    hf_dir: str | os.PathLike,
    expected: Mapping[str, Shape],
    aliases: Sequence[Sequence[str]] = (),
    adapter: StateDictAdapter | str | None = None,
) -> KeyReport:
    """`compare_shapes` of HF directory `hf_dir`'s tensors, named by the adapter, against `expected` (headers only)."""
    shapes, file_keys, _ = hf_shapes(hf_dir, adapter)
    return compare_shapes(expected, shapes, aliases, file_keys)
