"""The model registry: `model_id` (what users write in YAML) → a `ModelEntry`.

An entry is everything the trainer needs to know about a model family without
knowing the family: how to build it (on the CPU or on the meta device), its
default FSDP and activation-checkpointing plans as module name patterns, which
modules are the vision side, where `lm_head` is, how to fill the non-persistent
buffers after a meta build, and how HF checkpoint keys map to its state dict.
Adding a family means writing an entry and decorating it with
`@register_model("id")`, not editing the trainer.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import nn

from mmfsdp.config import Registry

__all__ = ["ModelEntry", "register_model", "get_model_entry", "registered_model_ids"]


class ModelEntry:
    """Base class of a registered model family; subclasses fill in the attributes and `build`."""

    model_id: str = ""
    fsdp_modules: tuple[str, ...] = ()
    """Default `parallel.fsdp_plan.apply_modules`: each matched module becomes one FSDP2 group."""
    recompute_modules: tuple[str, ...] = ()
    """Default activation-checkpointing patterns."""
    vision_modules: tuple[str, ...] = ()
    """Modules on the vision side: replicated over context parallel, run on whole images."""
    lm_head_name: str = "lm_head"
    """The output projection that receives the loss function under chunk loss."""
    hf_key_map: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) pairs renaming HF checkpoint keys to this model's; the first match applies."""

    def build(self, model_cfg: Any, features_cfg: Any = None, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
        raise NotImplementedError

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        raise NotImplementedError

    def validate_parallel(self, model_cfg: Any, plan: Any) -> None:
        """Checks of the parallel layout (`mmfsdp.parallel.MeshPlan`) against the model's config, before any
        process group; raise `ConfigError`. The default checks nothing."""


_REGISTRY: Registry[ModelEntry] = Registry("model id", "model.model_id")
E = TypeVar("E", bound=type[ModelEntry])


def register_model(model_id: str) -> Callable[[E], E]:
    """Class decorator: register one instance of the decorated `ModelEntry` subclass under `model_id`."""

    def decorate(cls: E) -> E:
        entry = cls()
        entry.model_id = model_id
        _REGISTRY.register(model_id, entry)
        return cls

    return decorate


def registered_model_ids() -> list[str]:
    return _REGISTRY.names()


def get_model_entry(model_id: str) -> ModelEntry:
    """The entry registered under `model_id`; an unknown id is a `ConfigError` naming the closest one."""
    return _REGISTRY.get(model_id)
