"""Activation offload by module name patterns: saved activations wait in host memory for backward.

`apply_activation_offload(model, patterns)` replaces the `forward` of every
matched module, on the instance (as activation checkpointing does, so module
and parameter names are unchanged), with one that runs the original forward
under `torch.autograd.graph.saved_tensors_hooks`:

1. pack (forward): each tensor autograd saves for backward inside the module
   is copied into host memory (pinned when it lives on an accelerator, with a
   non-blocking copy on the current stream) and the device copy is released
   with the rest of the forward's temporaries;
2. unpack (backward): the host copy is copied back to the device it came
   from (non-blocking, on the current stream, so it is ordered after the
   forward's copy and before the backward op that reads it).

Not offloaded (returned to autograd as they are): parameters and views of
them, the module's buffers and anything sharing their storage (with FSDP2 these are the gathered
parameters, which FSDP frees and gathers again itself), tensors already on
the CPU, tensors smaller than `min_bytes`, and tensor subclasses (DTensor,
quantised types).

With activation checkpointing (`apply_activation_checkpointing`, applied
first): the offload hooks wrap the checkpointed forward, so they see what the
checkpointed region saves for backward — its tensor inputs, which
`torch.utils.checkpoint` keeps for the recompute (the hidden states entering a
decoder layer). Inside the region checkpoint's own hooks take precedence, so
nothing is saved there and nothing else is offloaded; in backward the inputs
come back to the device and the recompute runs as usual. Keyword arguments of a
checkpointed module are held by the checkpoint, not saved, and stay where they are.

With FSDP2: apply before `apply_fsdp`. FSDP2's hooks sit in the module's
`__call__`, around the replaced forward, so the parameters are gathered when
the pack hook runs and are recognised by their storage.

Without gradients (`torch.no_grad`, evaluation) the original forward runs directly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from mmfsdp.parallel.patterns import wrap_forwards

__all__ = ["ActivationOffload", "apply_activation_offload", "is_offloaded"]


class ActivationOffload:
    """Pack/unpack hooks that move saved activations to host memory; counts what it kept and moved.

    `include_cpu` also copies tensors that are already on the CPU, so the whole
    pack/unpack path runs (and is counted) in CPU tests and benchmarks.
    """

    def __init__(self, *, min_bytes: int = 1024, include_cpu: bool = False):
        self.min_bytes = min_bytes
        self.include_cpu = include_cpu
        self.offloaded_bytes = 0
        """Bytes copied to the host by pack hooks."""
        self.kept_bytes = 0
        """Bytes of saved tensors left where they were (parameters, small or CPU tensors)."""

    def hooks(self, module: nn.Module) -> saved_tensors_hooks:
        """The saved-tensor hooks for one forward of `module` (its parameters and buffers are never moved)."""
        tensors = (*module.parameters(), *module.buffers())
        skip = {t.untyped_storage().data_ptr() for t in tensors if not isinstance(t, DTensor) and t.numel()}
        return saved_tensors_hooks(functools.partial(self._pack, skip), self._unpack)

    def _pack(self, skip: set[int], tensor: torch.Tensor) -> Any:
        num_bytes = tensor.numel() * tensor.element_size()
        base = tensor if tensor._base is None else tensor._base
        if (
            isinstance(base, nn.Parameter)
            or type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or num_bytes < self.min_bytes
            or (tensor.device.type == "cpu" and not self.include_cpu)
            or tensor.untyped_storage().data_ptr() in skip
        ):
            self.kept_bytes += num_bytes
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type != "cpu")
        host.copy_(tensor, non_blocking=True)
        self.offloaded_bytes += num_bytes
        return tensor.device, host

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


def _offloaded_forward(forward: Callable[..., Any], offload: ActivationOffload, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with offload.hooks(module):
        return forward(*args, **kwargs)


def is_offloaded(module: nn.Module) -> bool:
    """Whether `apply_activation_offload` has wrapped this module's forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _offloaded_forward


def apply_activation_offload(
    model: nn.Module,
    patterns: list[str],
    *,
    offload: ActivationOffload | None = None,
    key: str = "features.activation_offload_plan.apply_modules",
) -> list[str]:
    """Offload the saved activations of every module matched by `patterns` (after checkpointing, before FSDP).

    Returns the matched names; a pattern that matches nothing is a `ConfigError`
    under `key`. A module inside another matched module is skipped (the outer
    hooks already cover it), as are modules already wrapped.
    """
    offload = ActivationOffload() if offload is None else offload
    return wrap_forwards(
        model, patterns, lambda module: functools.partial(_offloaded_forward, module.forward, offload, module),
        key=key, what="apply_activation_offload", is_wrapped=is_offloaded, outermost_only=True,
    )
