"""Freezing modules by name pattern (`model.freeze`).

Patterns are those of `mmfsdp.parallel.match_module_names` (`{*}`, `{a-b}`,
full-name match); a pattern matching no module is a `ConfigError`. Freeze
before FSDP: frozen parameters are sharded like the others and get no gradient.
"""

from __future__ import annotations

from torch import nn

from mmfsdp.config import get_logger
from mmfsdp.parallel.patterns import match_module_names

__all__ = ["freeze_modules"]

log = get_logger(__name__)


def freeze_modules(model: nn.Module, patterns: list[str], *, key: str = "model.freeze") -> list[str]:
    """Set `requires_grad=False` on every parameter of the modules matched by `patterns`; return their names."""
    names = match_module_names(model, list(patterns), key=key)
    num_frozen = 0
    for name in names:
        for param in model.get_submodule(name).parameters():
            num_frozen += param.numel() if param.requires_grad else 0
            param.requires_grad_(False)
    log.info("froze %d modules (%.2fM parameters): %s", len(names), num_frozen / 1e6, ", ".join(names))
    return names
