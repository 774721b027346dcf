"""Live tensor bytes and their peak, measured through the dispatcher: a device-memory measure that works on the CPU.

On an accelerator the allocator counts peak memory (`torch.cuda.max_memory_allocated`); on the CPU nothing
does, and the process RSS is mostly the Python runtime. `TensorMemory` is a `TorchDispatchMode` that sees
every tensor an operator returns, adds its storage's bytes when the storage is new, and subtracts them when
the storage is freed (a weak-reference finaliser on the storage), so `peak` is the most tensor memory alive
at once inside the context. Tensors that exist before it (parameters, optimizer states) are counted with
`hold(...)`. A `DTensor` counts its local shard; storages shared by views count once.

Storages are told apart by their `StorageImpl` (`_cdata`), not by their data pointer, and resizing a storage
in place counts: FSDP2 frees an unsharded parameter after its layer with `storage.resize_(0)` and all-gathers
into the same storage object later (`resize_(size)`), which no operator shows. Inside the context
`UntypedStorage.resize_` reports to the counter, so a gathered layer counts while it is gathered and not after.
Keyed by data pointer, every gather looked like a new storage that was never freed (the whole unsharded model
counted from its first gather on), and whether a later allocation that reused a freed address was counted
depended on the allocator's address reuse, which changed from run to run.

What it cannot see: memory an operator allocates and frees inside one call (a kernel's workspace), and
tensors created outside the dispatcher (e.g. `torch.from_numpy`). Both are small next to the activations it
exists to measure.
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemory", "state_tensors"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor: its shard on this rank
    return to_local() if callable(to_local) else tensor


class TensorMemory(TorchDispatchMode):
    """`with TensorMemory(device_type) as mem: ...`; then `mem.peak` / `mem.current` in bytes."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # StorageImpl address -> bytes counted for it
        self._lock = threading.Lock()  # a storage can die on a communication thread
        self._resize = None

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        counter = weakref.ref(self)

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            mem = counter()
            if mem is not None:
                mem._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def hold(self, tensors: Iterable[torch.Tensor]) -> int:
        """Count tensors that already exist (each storage once); returns the bytes added."""
        added = 0
        for tensor in tensors:
            added += self._track(tensor)
        return added

    def _track(self, tensor: torch.Tensor) -> int:
        tensor = _local(tensor)
        if tensor.device.type != self.device_type or tensor.is_meta:
            return 0
        return self._track_storage(tensor.untyped_storage())

    def _track_storage(self, storage: torch.UntypedStorage) -> int:
        nbytes = storage.nbytes()
        key = storage._cdata
        with self._lock:
            if nbytes == 0 or key in self._bytes:
                return 0
            self._bytes[key] = nbytes
            self._add(nbytes)
        weakref.finalize(storage, self._free, key)
        return nbytes

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        if storage.device.type != self.device_type:
            return
        key = storage._cdata
        with self._lock:
            counted = self._bytes.get(key)
            if counted is not None:  # freed to 0 bytes or grown back: only the difference
                self._bytes[key] = storage.nbytes()
                self._add(storage.nbytes() - counted)
                return
        if storage.nbytes() > before:  # storage made before the context, allocated again inside it
            self._track_storage(storage)

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._bytes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """The tensors a training step starts with: parameters, their gradients, buffers and optimizer states."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
