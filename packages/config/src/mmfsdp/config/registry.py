"""Name → component registries, keyed by the names users write in YAML.

Templates, image plugins, collators, dataset types and model entries are each a
`Registry`; adding a model family means registering entries, not editing
if-chains. Looking up an unknown name is a `ConfigError` under the YAML key that
holds the name, with the closest registered name as a hint.
"""

from __future__ import annotations

import difflib
from typing import Generic, TypeVar

from mmfsdp.config.core import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, key: str):
        self.kind = kind
        """What the entries are, for messages ("collator", "image plugin")."""
        self.key = key
        """The YAML key path that names an entry, for errors."""
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str, *, key: str | None = None) -> T:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._entries), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                key or self.key, f"unknown {self.kind} {name!r}{hint}; registered: {', '.join(self.names())}"
            ) from None
