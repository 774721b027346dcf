"""Filling non-persistent buffers after a meta-device build.

A model built on the meta device and materialised with `to_empty` has
uninitialised storage everywhere; the checkpoint fills parameters and
persistent buffers, but rotary embeddings keep `inv_freq` (and
`original_inv_freq`) as non-persistent buffers that no checkpoint holds.
`init_rotary_buffers` rebuilds each rotary module from its own config on the
CPU — the same code path as a normal HF build — and copies those buffers onto
the module's device, so a meta-built, materialised and loaded model computes
exactly what the HF model does.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_rotary_buffers"]


def init_rotary_buffers(model: nn.Module) -> list[str]:
    """Recompute the non-persistent buffers of every rotary-embedding module; return the module names."""
    done = []
    for name, module in model.named_modules():
        if "inv_freq" not in getattr(module, "_non_persistent_buffers_set", ()) or not hasattr(module, "config"):
            continue
        device = module.inv_freq.device
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for buffer_name in module._non_persistent_buffers_set:
            setattr(module, buffer_name, getattr(fresh, buffer_name).to(device))
        done.append(name)
    return done
