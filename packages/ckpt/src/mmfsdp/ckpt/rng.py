"""Capture and restore this process's random number generator states in a `weights_only`-loadable form.

`capture_rng_state()` returns a dict of tensors, ints, floats and tuples only:
Python's `random` state as the tuple `random.getstate()` returns, NumPy's
global `RandomState` (when NumPy is installed) with its key array as an int64
tensor, the torch CPU generator, and the current accelerator generator
(`cuda`, or `npu` once `torch_npu` is imported) when that device is in use.
`save_checkpoint` stores it in each rank's `rank_<r>.pt`; `load_checkpoint`
restores it on the same rank when the world size is unchanged.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from mmfsdp.ckpt._log import warn_once

__all__ = ["capture_rng_state", "restore_rng_state"]

_DEVICE_TYPES = ("cuda", "npu")


def _device_module(device_type: str) -> Any | None:
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    try:
        if not module.is_available():
            return None
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None and not is_initialized():
            return None
    except RuntimeError:
        return None
    return module


def _numpy() -> Any | None:
    # Capture NumPy only if someone imported it: an unused generator needs no restoring.
    return sys.modules.get("numpy")


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, current accelerator device)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    for device_type in _DEVICE_TYPES:
        module = _device_module(device_type)
        if module is not None:
            state[device_type] = {"device": int(module.current_device()), "state": module.get_rng_state()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the states `capture_rng_state` returned (in this process)."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np  # noqa: PLC0415  (only when the checkpoint has a NumPy state)

        saved = state["numpy"]
        np.random.set_state(
            (saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        )
    for device_type in _DEVICE_TYPES:
        if device_type not in state:
            continue
        module = _device_module(device_type)
        if module is None:
            warn_once(f"checkpoint has a {device_type} RNG state but {device_type} is not in use here; not restored")
            continue
        module.set_rng_state(state[device_type]["state"])
