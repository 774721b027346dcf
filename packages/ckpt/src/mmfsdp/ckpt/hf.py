"""HF safetensors weight directories: read one tensor at a time, load into (FSDP2) models, write shards.

A HF weights directory is either one `model.safetensors` (or one other
`*.safetensors` file) or shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {key: file}}`).
`SafetensorsDir` reads only the headers up front and validates them (missing
files, keys the index and the files disagree on, duplicates). Tensor data is
read per tensor with `safe_open`, which memory-maps the file; the file is
closed after each tensor so a process never keeps more than that tensor mapped.

`load_hf_weights` copies each tensor into the model's parameters and persistent
buffers, named and combined by the family's state-dict adapter (`adapters`).
With FSDP2 a parameter is a DTensor holding one shard; for a renamed tensor only
that shard's slice is read (`get_slice` with the offsets of the DTensor's local
chunk), so a rank never holds a full parameter it does not own, let alone the
full model. A tensor the adapter transforms row by row (`FromHF.rowwise`: the
hub's transposed expert tensors) is read for this shard's rows (dim 0) only,
so a rank under expert parallel reads its own experts. A tensor the adapter
combines from several file tensors (per-expert exports) is read whole,
combined, and its local chunk copied. Values are
converted to the parameter's dtype and device by `copy_`.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from mmfsdp.ckpt.errors import CheckpointError, preview
from mmfsdp.ckpt.adapters import PlannedFromHF, StateDictAdapter, plan_from_hf, resolve_state_dict_adapter

__all__ = [
    "INDEX_FILENAME",
    "SafetensorsDir",
    "TensorInfo",
    "HFLoadResult",
    "load_hf_weights",
    "parse_size",
    "plan_shards",
    "shard_filename",
    "read_config",
    "SafetensorsWriter",
    "tensor_bytes",
]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def read_config(directory: str | os.PathLike) -> dict | None:
    """`config.json` of a HF directory, or None when there is none."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            header = {}
            for key in f.keys():
                part = f.get_slice(key)
                dtype_name = part.get_dtype()
                if dtype_name not in _DTYPES:
                    raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {dtype_name}")
                header[key] = (tuple(part.get_shape()), _DTYPES[dtype_name])
            return header
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


class SafetensorsDir:
    """The tensors of a HF safetensors directory, known from headers; data read on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"weights directory {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory; pass the directory that holds the safetensors files")
        self.files, index = self._find_files()
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for key, (shape, dtype) in _read_header(file).items():
                if key in self.tensors:
                    raise CheckpointError(f"tensor {key} is in both {self.tensors[key].file.name} and {file.name}")
                self.tensors[key] = TensorInfo(file, shape, dtype)
        if not self.tensors:
            raise CheckpointError(f"the safetensors files in {self.path} hold no tensors")
        if index is not None:
            self._check_index(index)

    def _find_files(self) -> tuple[list[Path], dict[str, str] | None]:
        index_path = self.path / INDEX_FILENAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is not a safetensors index ({type(e).__name__}: {e})") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has an empty or invalid weight_map")
            names = list(dict.fromkeys(weight_map.values()))
            missing = [name for name in names if not (self.path / name).is_file()]
            if missing:
                raise CheckpointError(f"{index_path} lists shard files that are missing: {', '.join(missing)}")
            return [self.path / name for name in names], weight_map
        if (self.path / SINGLE_FILENAME).is_file():
            return [self.path / SINGLE_FILENAME], None
        found = sorted(self.path.glob("*.safetensors"))
        if len(found) == 1:
            return found, None
        if not found:
            raise CheckpointError(
                f"no safetensors weights in {self.path} (expected {SINGLE_FILENAME} or {INDEX_FILENAME} with its shards)"
            )
        raise CheckpointError(
            f"{self.path} has {len(found)} safetensors files but no {INDEX_FILENAME}; "
            "restore the index that maps each tensor to its shard"
        )

    def _check_index(self, weight_map: dict[str, str]) -> None:
        not_found = [key for key, name in weight_map.items() if key not in self.tensors or self.tensors[key].file.name != name]
        unlisted = [key for key in self.tensors if key not in weight_map]
        if not_found or unlisted:
            lines = []
            if not_found:
                lines.append(f"{len(not_found)} keys listed in the index are not in the named shard: {preview(not_found)}")
            if unlisted:
                lines.append(f"{len(unlisted)} tensors in the shards are not in the index: {preview(unlisted)}")
            raise CheckpointError(f"{self.path / INDEX_FILENAME} does not match its shards:\n  " + "\n  ".join(lines))

    @property
    def config(self) -> dict | None:
        return read_config(self.path)

    def read(self, key: str) -> torch.Tensor:
        """The full tensor `key` (memory-mapped; the file is closed again)."""
        info = self.tensors[key]
        with safe_open(os.fspath(info.file), framework="pt") as f:
            return f.get_tensor(key)

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """`tensor[index]` for a tuple of slices, reading only that part."""
        info = self.tensors[key]
        with safe_open(os.fspath(info.file), framework="pt") as f:
            return f.get_slice(key)[index]


class HFLoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _alias_groups(state: dict[str, Any]) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for key, value in state.items():
        by_id.setdefault(id(value), []).append(key)
    return [keys for keys in by_id.values() if len(keys) > 1]


def _local_index(target: DTensor) -> tuple[slice, ...]:
    (chunk,) = target.__create_chunk_list__()
    return tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))


def _copy_into(target: torch.Tensor, weights: SafetensorsDir, plan: PlannedFromHF) -> None:
    local = target.to_local() if isinstance(target, DTensor) else target
    if local.numel() == 0:
        return
    index = _local_index(target) if isinstance(target, DTensor) else ()
    if plan.source.combine is None and index:
        local.copy_(weights.read_slice(plan.source.hf_keys[0], index))
        return
    if plan.source.rowwise and index:  # e.g. this rank's experts of a transposed expert tensor: only its rows
        rows = plan.source.combine([weights.read_slice(plan.source.hf_keys[0], index[:1])])
        local.copy_(rows[(slice(None), *index[1:])])
        return
    full = plan.build(weights.read)
    local.copy_(full[index] if index else full)


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    hf_dir: str | os.PathLike,
    *,
    adapter: StateDictAdapter | str | None = None,
    strict: bool = True,
    key_map: Callable[[str], str | None] | None = None,
) -> HFLoadResult:
    """Load a HF safetensors directory into `model`'s parameters and persistent buffers in place.

    `model` may be plain or FSDP2-sharded, but must be materialised (after
    `to_empty`, non-persistent buffers such as rotary `inv_freq` are the caller's
    to re-initialise). `adapter` maps file tensors to `state_dict()` tensors: a
    `StateDictAdapter`, a model id, or None for the one registered for
    `config.json`'s `model_type` (see `adapters`). Shape mismatches are always an
    error; with `strict`, missing and unexpected keys are too (tied weights count
    as present when one of their names is in the files). Returns the keys that
    were not loaded: model keys, and the file keys of model keys the model lacks.
    `key_map` gives, for each model `state_dict()` key, the model key the files hold
    it under (the adapter's naming), or None for a key the files do not hold and the
    caller fills itself (e.g. LoRA adapters around a base layer, `mmfsdp.ckpt.lora`).
    """
    weights = SafetensorsDir(hf_dir)
    adapter = resolve_state_dict_adapter(adapter, weights.config)
    plans = plan_from_hf(adapter, {key: (info.shape, info.dtype) for key, info in weights.tensors.items()})
    targets = model.state_dict(keep_vars=True)
    if key_map is not None:
        targets = {stored: value for key, value in targets.items() if (stored := key_map(key)) is not None}
    covered = set(plans)
    for group in _alias_groups(targets):
        if covered.intersection(group):
            covered.update(group)
    missing = [name for name in targets if name not in covered]
    unexpected = [key for name, plan in plans.items() if name not in targets for key in plan.source.hf_keys]
    mismatched = [
        f"{name}: model {tuple(targets[name].shape)}, file {plan.shape}"
        for name, plan in plans.items()
        if name in targets and tuple(targets[name].shape) != plan.shape
    ]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {preview(mismatched)}")
    if strict and missing:
        problems.append(f"{len(missing)} model keys not in the files: {preview(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} file keys the model does not have: {preview(unexpected)}")
    if problems:
        raise CheckpointError(
            f"weights in {weights.path} do not match the model:\n  " + "\n  ".join(problems)
            + f"\nCheck the model config and the state-dict adapter (here {adapter.name})."
        )
    on_meta = [name for name in plans if name in targets and targets[name].is_meta]
    if on_meta:
        raise CheckpointError(
            f"{len(on_meta)} model tensors are on the meta device ({preview(on_meta)}); "
            "materialise the model first, e.g. model.to_empty(device=...)"
        )
    for name, plan in plans.items():
        if name in targets:
            _copy_into(targets[name], weights, plan)
    return HFLoadResult(missing, unexpected)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes for "5GB" (10**9 units, as transformers), "500MiB" (2**20 units) or a plain number."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or 2GiB")
    number, unit = match.groups()
    size = int(float(number) * _UNITS[(unit or "B").upper()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Split (name, nbytes) in order into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes:
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards


def shard_filename(index: int, count: int) -> str:
    """`model-00001-of-00003.safetensors` (index from 0)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (valid while `tensor` lives)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SafetensorsWriter:
    """Write one safetensors file whose tensors are known up front, streaming each tensor's bytes.

    The header (names, dtypes, shapes, offsets) is written first; the caller then
    writes every tensor's raw bytes, in `order`, to `file` (by `write_tensor` or
    directly, e.g. with `os.copy_file_range`). Tensors are ordered by decreasing
    element size, then name, as safetensors itself does, so every tensor starts
    aligned to its element size. Nothing is held in memory.
    """

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str]) -> None:
        self.order = sorted(specs, key=lambda name: (-specs[name][1].itemsize, name))
        header: dict[str, Any] = {"__metadata__": metadata}
        self._nbytes: dict[str, int] = {}
        offset = 0
        for name in self.order:
            shape, dtype = specs[name]
            if dtype not in _DTYPE_NAMES:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            nbytes = TensorInfo(path, shape, dtype).nbytes
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._nbytes[name] = nbytes
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.file = open(path, "wb")
        self.file.write(len(encoded).to_bytes(8, "little"))
        self.file.write(encoded)
        self.file.flush()
        self._data_start = 8 + len(encoded)
        self._expected_end = self._data_start + offset
        self._written = 0

    def nbytes(self, name: str) -> int:
        return self._nbytes[name]

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor` (contiguous, on CPU) as the next tensor, `order[index]`."""
        assert name == self.order[self._written], (name, self._written)
        tensor = tensor.contiguous()
        self.file.write(tensor_bytes(tensor))
        self._written += 1

    def wrote_directly(self, name: str) -> None:
        """Record that `name`'s bytes were written to `file` by the caller."""
        assert name == self.order[self._written], (name, self._written)
        self._written += 1

    def close(self) -> None:
        self.file.flush()
        end = self.file.tell()
        self.file.close()
        assert self._written == len(self.order) and end == self._expected_end, (self._written, end, self._expected_end)
