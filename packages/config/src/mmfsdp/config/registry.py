"""Name → component registries, keyed by the names users write in YAML.

Templates, image plugins, collators, dataset types and model entries are each a
`Registry`; adding a model family means registering entries, not editing
if-chains. Looking up an unknown name is a `ConfigError` under the YAML key that
holds the name, with the closest registered name as a hint.

A registry given an `entry_point_group` imports every module declared in that group
(`importlib.metadata` entry points) the first time it is asked for a name or for its
names, so an installed package adds entries without anyone importing it. An entry may
carry aliases: old or alternative names users write, resolved by `get` and `canonical`,
never listed by `names`.
"""

from __future__ import annotations

import difflib
import functools
import sys
from typing import TYPE_CHECKING, Generic, TypeVar

from mmfsdp.config.core import ConfigError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoints

T = TypeVar("T")


@functools.lru_cache(maxsize=4)
def _all_entry_points(path: tuple[str, ...]) -> EntryPoints:
    from importlib.metadata import entry_points

    return entry_points()


def installed_entry_points(group: str) -> EntryPoints:
    """`importlib.metadata.entry_points(group=group)`, with the installed distributions scanned once per `sys.path`
    (the scan reads every distribution's metadata: ~10 ms, and each registry of each rank asked for it)."""
    return _all_entry_points(tuple(sys.path)).select(group=group)


class Registry(Generic[T]):
    def __init__(self, kind: str, key: str, *, entry_point_group: str | None = None):
        self.kind = kind
        """What the entries are, for messages ("collator", "image plugin")."""
        self.key = key
        """The YAML key path that names an entry, for errors."""
        self.entry_point_group = entry_point_group
        """Entry-point group whose modules register entries on import; loaded on the first lookup."""
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._loaded = entry_point_group is None

    def _load_entry_points(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for point in installed_entry_points(self.entry_point_group):
            point.load()

    def register(self, name: str, entry: T, *, aliases: tuple[str, ...] = ()) -> T:
        for taken in (name, *aliases):
            if taken in self._entries or taken in self._aliases:
                raise ValueError(f"{self.kind} {taken!r} is already registered")
        self._entries[name] = entry
        self._aliases.update(dict.fromkeys(aliases, name))
        return entry

    def names(self) -> list[str]:
        """The registered names (aliases not included)."""
        self._load_entry_points()
        return sorted(self._entries)

    def aliases(self) -> dict[str, str]:
        """alias -> registered name."""
        self._load_entry_points()
        return dict(self._aliases)

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries or name in self._aliases

    def get(self, name: str, *, key: str | None = None) -> T:
        if name is None:
            raise ConfigError(key or self.key, f"no {self.kind} given; name one of {', '.join(self.names())}")
        if name not in self._entries and name not in self._aliases:
            self._load_entry_points()
        try:
            return self._entries[self._aliases.get(name, name)]
        except KeyError:
            close = difflib.get_close_matches(str(name), [*self._entries, *self._aliases], n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                key or self.key, f"unknown {self.kind} {name!r}{hint}; registered: {', '.join(self.names())}"
            ) from None
