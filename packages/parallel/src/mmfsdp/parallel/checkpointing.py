"""Activation checkpointing (recompute) by module name patterns, without wrapper modules.

`apply_activation_checkpointing(model, patterns)` replaces the `forward` of
every matched module, on the instance, with one that runs the original forward
under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the
module's activations are dropped after forward and recomputed when backward
reaches it. No module is inserted, so parameter and state-dict names (and
therefore checkpoints and HF weight loading) are unchanged.

With FSDP2: apply this first, then `apply_fsdp`. FSDP2's hooks sit in the
module's `__call__`, around the replaced forward: before the module's backward
its pre-backward hook gathers the parameters, so the recompute (which calls the
original forward directly, not `__call__`) runs on full parameters and does
not gather again.

With context parallel: the recompute replays the same forward, including any
CP collectives inside attention, so it costs those collectives a second time;
the random state is restored (`preserve_rng_state`), so dropout masks match.
Without gradients (`torch.no_grad`, evaluation) the original forward runs
directly.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmfsdp.parallel.patterns import wrap_forwards

__all__ = ["apply_activation_checkpointing", "is_checkpointed"]


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # kwargs are bound rather than passed so they cannot collide with checkpoint's own options
    return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `apply_activation_checkpointing` has wrapped this module's forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def apply_activation_checkpointing(
    model: nn.Module, patterns: list[str], *, key: str = "parallel.recompute_plan.apply_modules"
) -> list[str]:
    """Checkpoint every module matched by `patterns` (before FSDP); return the matched names.

    A pattern that matches nothing is a `ConfigError` under `key`. Modules already
    wrapped are left as they are.
    """
    return wrap_forwards(
        model, patterns, lambda module: functools.partial(_checkpointed_forward, module.forward),
        key=key, what="apply_activation_checkpointing", is_wrapped=is_checkpointed,
    )
