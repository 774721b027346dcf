"""Module name patterns for FSDP and recompute plans.

A pattern is a full module name (as in `model.named_modules()`) in which
- `{*}` matches any integer index (`model.layers.{*}` matches `model.layers.0`,
  `model.layers.17`, ...),
- `{a-b}` matches an integer index from `a` to `b` inclusive,
- everything else, dots included, is literal.

The whole name must match: `layers.{*}` matches `layers.3` but not
`layers.3.mlp` nor `model.layers.3`. A pattern that matches nothing is a
`ConfigError` listing similar module names, so a typo never silently leaves a
model unsharded or un-checkpointed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from mmfsdp.config import ConfigError

__all__ = ["ModulePattern", "compile_module_pattern", "match_module_names", "wrap_forwards"]

_BRACES = re.compile(r"\{([^{}]*)\}")
_INDEX = r"(0|[1-9][0-9]*)"
_RANGE = re.compile(r"([0-9]+)-([0-9]+)")
_NUMERIC_PART = re.compile(r"(?<=\.)[0-9]+(?=\.|$)|^[0-9]+(?=\.|$)")
_SYNTAX = "use {*} for any index or {a-b} for an inclusive range, e.g. model.layers.{0-11}"


@dataclass(frozen=True, slots=True)
class ModulePattern:
    """A compiled module name pattern: `matches(name)` is a full-name match."""

    text: str
    regex: re.Pattern[str]
    ranges: tuple[tuple[int, int] | None, ...]

    def matches(self, name: str) -> bool:
        found = self.regex.fullmatch(name)
        if found is None:
            return False
        for index, bounds in zip(found.groups(), self.ranges):
            if bounds is not None and not bounds[0] <= int(index) <= bounds[1]:
                return False
        return True


def compile_module_pattern(pattern: str, *, key: str = "pattern") -> ModulePattern:
    """Compile `pattern`; a malformed one (`{3-1}`, `{x}`, an unmatched brace) is a `ConfigError` under `key`."""
    if not pattern:
        raise ConfigError(key, "an empty module pattern matches nothing; remove it or write a module name")
    parts: list[str] = []
    ranges: list[tuple[int, int] | None] = []
    position = 0
    for brace in _BRACES.finditer(pattern):
        parts.append(_literal(pattern[position : brace.start()], pattern, key))
        body = brace.group(1)
        if body == "*":
            ranges.append(None)
        elif (bounds := _RANGE.fullmatch(body)) is not None:
            low, high = int(bounds.group(1)), int(bounds.group(2))
            if low > high:
                raise ConfigError(key, f"{pattern!r}: range {{{body}}} is empty (start > end); write {{{high}-{low}}}")
            ranges.append((low, high))
        else:
            raise ConfigError(key, f"{pattern!r}: {{{body}}} is not an index pattern; {_SYNTAX}")
        parts.append(_INDEX)
        position = brace.end()
    parts.append(_literal(pattern[position:], pattern, key))
    return ModulePattern(text=pattern, regex=re.compile("".join(parts)), ranges=tuple(ranges))


def _literal(text: str, pattern: str, key: str) -> str:
    if "{" in text or "}" in text:
        raise ConfigError(key, f"{pattern!r} has an unmatched brace; {_SYNTAX}")
    return re.escape(text)


def _generalise(name: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.{*}.mlp`: the spelling of a family of modules."""
    return _NUMERIC_PART.sub("{*}", name)


def _suggestions(pattern: str, names: list[str]) -> str:
    families = list(dict.fromkeys(_generalise(name) for name in names))
    close = difflib.get_close_matches(pattern, families, n=5, cutoff=0.5)
    if not close:
        close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
    if close:
        return "similar module names: " + ", ".join(close)
    return "module names start like: " + ", ".join(families[:5])


def match_module_names(model: nn.Module, patterns: list[str], *, key: str = "patterns") -> list[str]:
    """Names of the modules of `model` matched by any of `patterns`, in model order, each once.

    Every pattern must match at least one module (the root, named "", is never matched);
    otherwise a `ConfigError` keyed `key[i]` names similar modules.
    """
    compiled = [compile_module_pattern(pattern, key=f"{key}[{i}]") for i, pattern in enumerate(patterns)]
    names = [name for name, _ in model.named_modules() if name]
    used = [False] * len(compiled)
    matched = []
    for name in names:
        hit = False
        for i, pattern in enumerate(compiled):
            if pattern.matches(name):
                used[i] = hit = True
        if hit:
            matched.append(name)
    for i, pattern in enumerate(compiled):
        if not used[i]:
            raise ConfigError(
                f"{key}[{i}]",
                f"{pattern.text!r} matches no module of {type(model).__name__}; {_suggestions(pattern.text, names)}",
            )
    return matched


def wrap_forwards(
    model: nn.Module,
    patterns: list[str],
    wrap: Callable[[nn.Module], Callable[..., Any]],
    *,
    key: str,
    what: str,
    is_wrapped: Callable[[nn.Module], bool],
    outermost_only: bool = False,
) -> list[str]:
    """Replace, on the instance, the `forward` of every module matched by `patterns` with `wrap(module)` (which
    closes over `module.forward`); return the matched names. No module is inserted, so parameter and state-dict
    names do not change. The one loop behind per-block compile, activation checkpointing and activation offload.

    Runs on the unsharded model (before FSDP2, whose hooks then sit around the replaced forward); `what` names the
    caller in that error. A pattern that matches nothing is a `ConfigError` under `key`; modules for which
    `is_wrapped` holds are left as they are; with `outermost_only`, a module inside another matched one is skipped.
    """
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        raise RuntimeError(f"{what} must run before apply_fsdp, on the unsharded model")
    names = match_module_names(model, patterns, key=key)
    for name in names:
        if outermost_only and any(name.startswith(other + ".") for other in names):
            continue
        module = model.get_submodule(name)
        if not is_wrapped(module):
            module.forward = wrap(module)
    return names
