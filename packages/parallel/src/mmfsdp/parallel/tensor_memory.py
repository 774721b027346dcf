"""Live tensor bytes and their peak, measured through the dispatcher: a device-memory measure that works on the CPU.

On an accelerator the allocator counts peak memory (`torch.cuda.max_memory_allocated`); on the CPU nothing
does, and the process RSS is mostly the Python runtime. `TensorMemory` is a `TorchDispatchMode` that sees
every tensor an operator returns, adds its storage's bytes when the storage is new, and subtracts them when
the storage is freed (a weak-reference finaliser on the storage), so `peak` is the most tensor memory alive
at once inside the context. Tensors that exist before it (parameters, optimizer states) are counted with
`hold(...)`. A `DTensor` counts its local shard; storages shared by views count once.

What it cannot see: memory an operator allocates and frees inside one call (a kernel's workspace), and
tensors created outside the dispatcher (e.g. `torch.from_numpy`). Both are small next to the activations it
exists to measure.
"""

from __future__ import annotations

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
        self._live: set[int] = set()

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
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key in self._live:
            return 0
        self._live.add(key)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, nbytes)
        return nbytes

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._live:
            self._live.discard(key)
            self.current -= nbytes

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
