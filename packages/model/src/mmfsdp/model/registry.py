"""The model ids: `model_id` (what users write in YAML) → a registered family spec (`mmfsdp.model.spec`).

A family registers its spec with `@register_model("id")` (`mmfsdp.model.spec`) when its module is imported, and
an installed package declares that module in the `mmfsdp.model_families` entry-point group, so that
`registered_model_ids()` knows the id without importing the module and `get_model_entry` imports it on first use.
This module holds the ids and the registered specs and knows nothing of what a spec is: reading a config
(`mmfsdp.model.config` checks `model.model_id` against these ids) imports no family and no spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmfsdp.config import Registry, installed_entry_points

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "FAMILY_ENTRY_POINT_GROUP", "add_family", "find_family", "installed_model_ids", "load_all_families",
    "registered_model_ids",
]

FAMILY_ENTRY_POINT_GROUP = "mmfsdp.model_families"
"""Entry-point group declaring families: name = model id, value = the module whose import registers it."""

_REGISTRY: Registry[object] = Registry("model id", "model.model_id")
"""The registered specs (`mmfsdp.model.spec.ModelEntry`; `get_model_entry` gives them their type)."""


def _declared_families() -> dict[str, EntryPoint]:
    return {point.name: point for point in installed_entry_points(FAMILY_ENTRY_POINT_GROUP)}


def installed_model_ids() -> list[str]:
    """The model ids installed packages declare (entry points), without those a test or a script registered."""
    return sorted(_declared_families())


def registered_model_ids() -> list[str]:
    """Every model id: the registered ones and those a package declares (their modules are not imported)."""
    return sorted(set(_REGISTRY.names()) | set(_declared_families()))


def add_family(model_id: str, spec: object) -> None:
    """Register `spec` under `model_id` (`register_model` does, for its class)."""
    _REGISTRY.register(model_id, spec)


def _load_family(model_id: str) -> None:
    point = _declared_families().get(model_id)
    if point is None or model_id in _REGISTRY:
        return
    point.load()  # the module's @register_model runs on import
    if model_id not in _REGISTRY:
        raise RuntimeError(f"entry point {point.value!r} of group {FAMILY_ENTRY_POINT_GROUP} did not register {model_id!r}")


def load_all_families() -> None:
    """Import every family a package declares (e.g. once in a process that forks workers)."""
    for model_id in _declared_families():
        _load_family(model_id)


def find_family(model_id: str) -> object:
    """The spec registered under `model_id`, importing its family on first use; an unknown id is a `ConfigError`
    naming the closest one."""
    if model_id not in _REGISTRY:
        _load_family(model_id)
    if model_id not in _REGISTRY:
        load_all_families()
    return _REGISTRY.get(model_id)
