"""Counting host round trips: the calls that make the host wait for the device (or copy to it from Python).

On an accelerator, `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `if tensor:` / `int(tensor)` and every op whose
output shape depends on the data (`nonzero`, boolean-mask indexing, `repeat_interleave` by a tensor) stop the host
until the device has caught up; `torch.tensor(python_list)` on the device copies from pageable host memory. The
hot path (the decoder layers) must make none of them: what the layers need from a batch is worked out once per
micro-batch, on the host, before the forward (`mmfsdp.model.packed_plan`).

`HostSyncCounter` is a `TorchFunctionMode` that counts those calls by kind and by call site. It counts them on
every tensor, whatever its device, so a CPU run counts what a GPU run would wait for — with two exceptions that
only a device can tell apart: a host tensor's own `.tolist()` is free on a GPU, and a copy to the device is a
round trip only from pageable memory or when blocking. Code that works on host tensors it made itself (the
micro-batch plan reading bounds the collator wrote) runs inside `host_side()`, which the counter leaves out; on
a device (`device_only=True`, what `tools/bench/gpu_check.py` uses) the counter instead skips CPU tensors and
counts blocking or pageable host-to-device copies.

`count_host_syncs(step)` runs `step()` (a training forward + backward) under a counter and returns it;
`HostSyncCounter.report()` is the one-line summary the tests and `tools/bench/host_syncs.py` print
(`mmfsdp.model.host_sync_probe` trains one packed micro-batch of a tiny family under it).
Calls made inside a module registered with `attribute_layers` are also counted apart (`in_layers`): the decoder
layers' forward, where the goal is exactly zero.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter", "count_host_syncs", "host_side"]

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
}
_DATA_DEPENDENT = {
    torch.nonzero: "nonzero",
    torch.Tensor.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.Tensor.argwhere: "nonzero",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
}
_FROM_PYTHON = {torch.tensor: "tensor(python)", torch.as_tensor: "tensor(python)"}
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put)
_REPEAT = (torch.repeat_interleave, torch.Tensor.repeat_interleave)
_MOVES = (torch.Tensor.to, torch.Tensor.cuda)

_host = threading.local()


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Code that works on host tensors only (the micro-batch plan's build): not counted by a `HostSyncCounter`."""
    depth = getattr(_host, "depth", 0)
    _host.depth = depth + 1
    try:
        yield
    finally:
        _host.depth = depth


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _bool_index(index: Any) -> bool:
    return any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(index))


class HostSyncCounter(TorchFunctionMode):
    """Counts host round trips by kind (`counts`), by call site (`sites`) and inside attributed layers."""

    def __init__(self, *, device_only: bool = False):
        super().__init__()
        self.device_only = device_only
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.in_layers: Counter[str] = Counter()
        self._layer_depth = 0
        self._handles: list[Any] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def attribute_layers(self, layers: Iterable[nn.Module]) -> HostSyncCounter:
        """Count the calls made inside these modules' forward apart (`in_layers`)."""
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(layer.register_forward_hook(self._leave, always_call=True))
        return self

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, *_: Any) -> None:
        self._layer_depth += 1

    def _leave(self, *_: Any) -> None:
        self._layer_depth -= 1

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return not self.device_only or tensor.device.type != "cpu"

    def _kind(self, func: Callable, args: tuple, kwargs: dict) -> str | None:
        if func in _READS:
            return _READS[func] if self._on_device(args[0]) else None
        if func in _DATA_DEPENDENT:
            return _DATA_DEPENDENT[func] if self._on_device(args[0]) else None
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "nonzero" if self._on_device(args[0]) else None
        if func in _FROM_PYTHON:
            data = args[0] if args else kwargs.get("data")
            if torch.is_tensor(data):
                return None
            device = kwargs.get("device")
            on_cpu = device is None or torch.device(device).type == "cpu"
            return None if self.device_only and on_cpu else _FROM_PYTHON[func]
        if func in _INDEXING:
            index = args[1] if len(args) > 1 else None
            return "bool_index" if _bool_index(index) and self._on_device(args[0]) else None
        if func in _REPEAT:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if torch.is_tensor(repeats) and repeats.numel() > 1 and kwargs.get("output_size") is None:
                return "repeat_interleave" if self._on_device(repeats) else None
            return None
        if func in _MOVES and self.device_only and args[0].device.type == "cpu":
            target = next((a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))), None)
            if func is torch.Tensor.cuda or (target is not None and torch.device(target).type != "cpu"):
                pinned_async = kwargs.get("non_blocking", False) and args[0].is_pinned()
                return None if pinned_async else "host_to_device"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_host, "depth", 0):
            kind = self._kind(func, args, kwargs)
            if kind is not None:
                self.counts[kind] += 1
                self.sites[f"{kind} at {_call_site()}"] += 1
                if self._layer_depth:
                    self.in_layers[kind] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        """`N host round trips (M in the layers): kind × n, ...`."""
        kinds = ", ".join(f"{kind} × {n}" for kind, n in sorted(self.counts.items())) or "none"
        return f"{self.total} host round trips ({sum(self.in_layers.values())} in the layers): {kinds}"


def _call_site() -> str:
    """The innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path == __file__ or "/torch/" in path):
            return f"{path.rsplit('/site-packages/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def count_host_syncs(
    step: Callable[[], Any], layers: Iterable[nn.Module] = (), *, device_only: bool = False
) -> HostSyncCounter:
    """Run `step()` (e.g. a training forward and backward) under a `HostSyncCounter`, the calls inside `layers`'
    forward counted apart too; returns the counter."""
    counter = HostSyncCounter(device_only=device_only).attribute_layers(layers)
    try:
        with counter:
            step()
    finally:
        counter.remove_hooks()
    return counter

