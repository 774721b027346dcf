"""Readers, writers and planners around `torch.distributed.checkpoint` (DCP) that this package uses.

- `SafeFileSystemReader` reads DCP's `.metadata` with an unpickler that only
  admits DCP's own metadata classes, `torch.Size`, dtypes and paths, so opening
  a checkpoint never runs arbitrary code.
- `SafeLoadPlanner` loads the non-tensor items of a checkpoint (optimizer
  `param_groups`) with `torch.load(weights_only=True)` instead of DCP's default
  `weights_only=False`.
- `LazySavePlanner` saves a state dict of *meta* tensors whose data is produced
  by a callback only when the writer asks for that item. Together with
  `FileSystemWriter(single_file_per_rank=False)` (one file per tensor, written
  and released one at a time) this writes a DCP checkpoint while holding one
  tensor in memory: how `hf_to_dcp` stays near the size of the largest tensor.
- `stored_tensor_file` finds where a tensor's bytes lie when it is the only item
  of a data file (that layout), so `dcp_to_hf` can copy them inside the kernel.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.hf import tensor_bytes
from mmfsdp.ckpt.layout import DCP_METADATA_FILENAME

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "LazySavePlanner",
    "read_dcp_metadata",
    "tensor_entries",
    "quiet_single_process",
    "stored_tensor_file",
]

_DCP_MODULE = "torch.distributed.checkpoint."
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_MODULE) or (module, name) in _ALLOWED_GLOBALS:
            obj = super().find_class(module, name)
            if module.startswith(_DCP_MODULE) and not isinstance(obj, type):
                raise pickle.UnpicklingError(f"refusing {module}.{name} in DCP metadata")
            return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` unpickling admits only DCP metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        path = Path(self.path) / DCP_METADATA_FILENAME
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path.parent} is not a DCP checkpoint: {DCP_METADATA_FILENAME} is missing") from None
        except CheckpointError:
            raise
        except Exception as e:  # garbage bytes fail in many ways inside the unpickler
            raise CheckpointError(f"cannot read DCP metadata {path}: {e}; the file is damaged or not a DCP checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata (found {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that unpickles non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_path(root: Any, path: tuple, value: Any) -> None:
    """Set `root[path[0]][path[1]]... = value`, creating dicts (str keys) and lists (int keys) on the way."""
    node = root
    for key, next_key in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(next_key, int) else {}
        elif key not in node:
            node[key] = [] if isinstance(next_key, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


class LazySavePlanner(DefaultSavePlanner):
    """Save a state dict of meta tensors; `load(fqn)` returns each tensor's data when it is written.

    `fqn` is the flattened DCP key (`model.<param name>`). The returned tensor must
    have the meta tensor's shape and dtype; it is dropped after it is written.
    """

    def __init__(self, load: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._load = load

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        tensor = self._load(fqn)
        expected = write_item.tensor_data
        assert expected is not None
        if tuple(tensor.shape) != tuple(expected.size) or tensor.dtype != expected.properties.dtype:
            raise CheckpointError(
                f"{fqn}: source tensor is {tuple(tensor.shape)} {tensor.dtype}, but its header says "
                f"{tuple(expected.size)} {expected.properties.dtype}; the weights file is inconsistent"
            )
        return tensor


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of checkpoint directory `path` (read safely)."""
    return SafeFileSystemReader(os.fspath(path)).read_metadata()


def tensor_entries(metadata: Metadata, prefix: str) -> dict[str, TensorStorageMetadata]:
    """`{name: TensorStorageMetadata}` for the tensors under `prefix` (e.g. "model."), prefix removed, in saved order."""
    return {
        key[len(prefix):]: value
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)
    }


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" warning (we mean it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def stored_tensor_file(path: str | os.PathLike, metadata: Metadata, fqn: str) -> tuple[Path, int, int] | None:
    """(file, data offset, nbytes) when tensor `fqn` is the only item of one DCP data file, stored plainly.

    That is the layout `FileSystemWriter(single_file_per_rank=False)` writes (as
    `hf_to_dcp` does): the file is one `torch.save` zip whose single data record
    holds the tensor's bytes, uncompressed and contiguous. Its bytes can then be
    copied to another file inside the kernel. Returns None for any other layout
    (several chunks, e.g. FSDP shards; several items per file; stream transforms),
    which callers read through `dcp.load` instead.
    """
    entry = metadata.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata) or len(entry.chunks) != 1:
        return None
    chunk = entry.chunks[0]
    if any(chunk.offsets) or tuple(chunk.sizes) != tuple(entry.size):
        return None
    storage = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets)) if metadata.storage_data else None
    relative_path = getattr(storage, "relative_path", None)
    if relative_path is None or getattr(storage, "offset", None) != 0 or getattr(storage, "transform_descriptors", None):
        return None
    file = Path(path) / relative_path
    nbytes = entry.size.numel() * entry.properties.dtype.itemsize
    try:
        if storage.length != file.stat().st_size:
            return None
        tensor = torch.load(file, mmap=True, weights_only=True)  # maps the file; reads no data yet
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype == entry.properties.dtype
                and tuple(tensor.shape) == tuple(entry.size) and tensor.is_contiguous()
                and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes):
            return None
        data_offset = _zip_data_offset(file, nbytes)
        if data_offset is None:
            return None
        head = min(nbytes, 4096)
        with open(file, "rb") as f:
            f.seek(data_offset)
            if f.read(head) != bytes(tensor_bytes(tensor)[:head]):
                return None
    except (OSError, RuntimeError, zipfile.BadZipFile, pickle.UnpicklingError):
        return None
    return file, data_offset, nbytes


def _zip_data_offset(file: Path, nbytes: int) -> int | None:
    with zipfile.ZipFile(file) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != nbytes:
        return None
    with open(file, "rb") as f:
        f.seek(records[0].header_offset)
        local_header = f.read(30)
    if len(local_header) != 30 or local_header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", local_header[26:30])
    return records[0].header_offset + 30 + name_length + extra_length
