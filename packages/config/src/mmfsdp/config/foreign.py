"""Keys of another framework's schema, translated into ours before the strict builder.

A section lists, next to its fields, the keys of other schemas it accepts:

    @dataclass(kw_only=True, slots=True)
    class LossConfig:
        foreign_keys: ClassVar[dict[str, ForeignKey]] = {
            "loss_type": Alias(values={"per_sample_loss": "per_sample"}),   # our key, their value name
        }

    class BasicParametersConfig:
        foreign_keys = {
            "cutoff_len": Alias("data.dataset_param.preprocess_parameters.cutoff_len"),   # their place
            "preprocessing_batch_size": Ignored("tokenizer batching; the tokens are the same"),
            "static_param.level": Ignored(...),   # a dotted key: a mapping of theirs that is no section of ours
        }

`translate(Config, mapping)` rewrites the raw YAML mapping into our spelling, in
place of nothing else: a key the section does not hold and its table does not
list stays where it is, so `build` reports it with the closest key. How it goes:

1. Walk the mapping along the dataclasses. In each section, every key that is
   not a field is looked up in the table (a dotted entry `a.b` covers key `b`
   of the mapping under key `a`) and removed: an `Alias` moves its value to the
   target path (from the config root), with `values` translated; an `Ignored`
   is noted with its reason (a value outside `allowed` is an error: the setting
   asks for something mmfsdp does not do); a `Translate` hands the value to a
   function that returns target paths and values. A field listed as an `Alias`
   with no target keeps its place and only has its value translated.
2. Put every moved value at its target. A target that already holds a different
   value is an error naming both keys (a mapping is merged key by key).
3. Walk again until nothing moves: a moved mapping may hold keys of the other
   schema itself (`model.loss_cfg.loss_type: per_sample_loss` moves to
   `features.loss_cfg` and is then translated there).

Keys of the config root that the YAML file only uses to hold an anchor
(`HF_PATH: &HF_PATH /models/x`, referred to later as `*HF_PATH`) are ignored too.
Overrides (`key.path=value`) go through the same tables, so either spelling works
on the command line and overrides the file's value whichever spelling that used.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Union, get_args, get_origin

import yaml

from mmfsdp.config.core import (SAFE_LOADER, ConfigError, field_types, load_yaml, parent_section, parse_override,
                                safe_dump)

__all__ = [
    "Alias",
    "ForeignKey",
    "Ignored",
    "Translate",
    "Translated",
    "foreign_entries",
    "load_translated",
    "translate",
]


@dataclass(frozen=True)
class Alias:
    """Their key (or value) for one of ours."""

    target: str | None = None
    """Dotted path from the config root where the value goes; None = this same key, only `values` translated."""
    values: Mapping[Any, Any] = field(default_factory=dict)
    """Their value → ours; a value not listed passes unchanged."""


@dataclass(frozen=True)
class Ignored:
    """A key of theirs that mmfsdp accepts and does not use."""

    reason: str
    """Why it changes nothing here (printed in the warning line)."""
    allowed: tuple[Any, ...] | None = None
    """The values accepted; any other is an error (it asks for what mmfsdp does not do). None = any value."""


@dataclass(frozen=True)
class Translate:
    """A key of theirs whose value needs more than a move: `function(value, section mapping, key path)` returns
    `{target path: value}` (and raises `ConfigError` for what cannot be translated)."""

    function: Callable[[Any, dict[str, Any], str], dict[str, Any]]
    doc: str
    """What it becomes, for the docs."""


ForeignKey = Union[Alias, Ignored, Translate]


@dataclass
class Translated:
    """A mapping in our spelling, and what was translated to get it."""

    data: dict[str, Any]
    ignored: list[tuple[str, str]] = field(default_factory=list)
    """(key path, reason) of each ignored key, in file order."""
    renamed: list[tuple[str, str]] = field(default_factory=list)
    """(their key path, our key path) of each alias used."""

    def warning(self) -> str | None:
        """The one warning line listing every ignored key and why; None when nothing was ignored."""
        if not self.ignored:
            return None
        by_reason: dict[str, list[str]] = {}
        for key, reason in self.ignored:
            by_reason.setdefault(reason, []).append(key)
        items = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
        return f"ignored {len(self.ignored)} key(s) of another schema (docs/migration.md): {items}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (also through `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        found = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _table(cls: type) -> dict[str, ForeignKey]:
    return dict(getattr(cls, "foreign_keys", {}) or {})


def foreign_entries(cls: type, path: str = "") -> list[tuple[str, ForeignKey]]:
    """(their key path, entry) of every table under `cls`, depth first: what docs/migration.md must list."""
    out = [(_join(path, key), entry) for key, entry in _table(cls).items()]
    hints = field_types(cls)
    for name in (f.name for f in dataclasses.fields(cls)):
        sub = _section_type(hints[name])
        if sub is not None:
            out += foreign_entries(sub, _join(path, name))
    return out


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _Walk:
    def __init__(self, root_path: str):
        self.root_path = root_path
        self.moves: list[tuple[str, str, Any]] = []
        self.ignored: list[tuple[str, str]] = []
        self.renamed: list[tuple[str, str]] = []

    def section(self, cls: type, mapping: dict[str, Any], path: str) -> None:
        hints = field_types(cls)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        table = _table(cls)
        for key in [k for k in mapping if k not in fields]:  # theirs first: a Translate sees the raw siblings
            self.foreign(table, mapping, str(key), path)
        for key in [k for k in mapping if k in fields]:
            entry = table.get(key)
            value = mapping[key]
            if isinstance(entry, Alias) and entry.target is None and _hashable(value) and value in entry.values:
                mapping[key] = entry.values[value]
                self.renamed.append((f"{_join(path, key)}: {value}", f"{_join(path, key)}: {mapping[key]}"))
            sub = _section_type(hints[key])
            if sub is not None and isinstance(mapping[key], dict):
                self.section(sub, mapping[key], _join(path, key))

    def foreign(self, table: dict[str, ForeignKey], mapping: dict[str, Any], key: str, path: str) -> None:
        entry = table.get(key)
        if entry is not None:
            self.apply(entry, mapping.pop(key), mapping, _join(path, key))
            return
        nested = {k[len(key) + 1 :]: e for k, e in table.items() if k.startswith(key + ".")}
        if nested and isinstance(mapping[key], dict):
            self.foreign_mapping(nested, mapping.pop(key), _join(path, key))
        # otherwise an unknown key: left in place for `build` to report with the closest key

    def foreign_mapping(self, table: dict[str, ForeignKey], mapping: dict[str, Any], path: str) -> None:
        """A mapping of theirs that is no section of ours: every key must be in `table`."""
        for key in list(mapping):
            key = str(key)
            if key in table:
                self.apply(table[key], mapping.pop(key), mapping, _join(path, key))
                continue
            nested = {k[len(key) + 1 :]: e for k, e in table.items() if k.startswith(key + ".")}
            if nested and isinstance(mapping[key], dict):
                self.foreign_mapping(nested, mapping.pop(key), _join(path, key))
                continue
            known = sorted({k.split(".")[0] for k in table})
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean '{_join(path, close[0])}'?)" if close else ""
            raise ConfigError(_join(path, key), f"unknown key{hint}; valid keys here: {', '.join(known)}")

    def apply(self, entry: ForeignKey, value: Any, mapping: dict[str, Any], path: str) -> None:
        if isinstance(entry, Ignored):
            if entry.allowed is not None and not any(value == a and type(value) is type(a) for a in entry.allowed):
                accepted = " or ".join(_yaml_scalar(a) for a in entry.allowed)
                raise ConfigError(
                    path, f"{value!r} is not supported: {entry.reason}; remove the key or set it to {accepted}"
                )
            self.ignored.append((path, entry.reason))
        elif isinstance(entry, Alias):
            assert entry.target is not None, f"{path}: an alias of a key that is not a field needs a target"
            moved = entry.values.get(value, value) if _hashable(value) else value
            self.moves.append((path, entry.target, moved))
            self.renamed.append((path, entry.target))
        else:
            for target, moved in entry.function(value, mapping, path).items():
                self.moves.append((path, target, moved))
                self.renamed.append((path, target))


def _yaml_scalar(value: Any) -> str:
    return safe_dump(value).strip().removesuffix("...").strip()


def _put(data: dict[str, Any], root_path: str, source: str, target: str, value: Any) -> None:
    """Set `target` (a path from the config root) in `data` (the mapping at `root_path`) to `value`."""
    if root_path:
        if not target.startswith(root_path + "."):
            return  # outside the part being translated: its owner does not read it
        target = target[len(root_path) + 1 :]
    parts = target.split(".")
    node = parent_section(data, parts, source, prefix=root_path)
    _merge(node, parts[-1], value, source, _join(root_path, target))


def _merge(node: dict[str, Any], key: str, value: Any, source: str, target: str) -> None:
    if key not in node or node[key] is None:
        node[key] = value
    elif isinstance(node[key], dict) and isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _merge(node[key], sub_key, sub_value, _join(source, sub_key), _join(target, sub_key))
    elif node[key] != value:
        raise ConfigError(
            source, f"{value!r} conflicts with {target}: {node[key]!r} in the same config; keep one of the two"
        )


def translate(cls: type, data: dict[str, Any] | None, path: str = "", *, anchored: tuple[str, ...] = ()) -> Translated:
    """`data` (the raw mapping of section `cls` at `path`) in our spelling; `data` itself is left unchanged.

    `anchored`: keys of `data` that only hold a YAML anchor (ignored unless they are fields).
    """
    result = copy.deepcopy(data) if isinstance(data, dict) else {}
    out = Translated(result)
    if not isinstance(data, dict):
        out.data = data  # type: ignore[assignment]  # `build` reports a non-mapping
        return out
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in anchored:
        if key in result and key not in fields:
            del result[key]
            out.ignored.append(
                (_join(path, key), "holds only a YAML anchor; its value is used where the anchor is referred to")
            )
    for _ in range(16):
        walk = _Walk(path)
        walk.section(cls, result, path)
        out.ignored += walk.ignored
        out.renamed += walk.renamed
        if not walk.moves:
            return out
        for source, target, value in walk.moves:
            _put(result, path, source, target, value)
    raise AssertionError(f"foreign keys of {cls.__name__} keep moving: a cycle in the alias tables")


class _Marker:
    """Stands for an override's value while its key path is translated."""

    def __deepcopy__(self, memo: dict) -> "_Marker":
        return self


def _find(node: Any, marker: _Marker, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    if node is marker:
        return path
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find(value, marker, (*path, str(key)))
            if found is not None:
                return found
    return None


def _nested(parts: list[str], value: Any) -> dict[str, Any]:
    for part in reversed(parts):
        value = {part: value}
    return value


def _leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, (*path, str(key)))
        else:
            out.append(((*path, str(key)), value))
    return out


def _set(data: dict[str, Any], parts: tuple[str, ...], value: Any, text: str) -> None:
    parent_section(data, parts, repr(text))[parts[-1]] = value


def _anchored_top_level_keys(text: str) -> tuple[str, ...]:
    """Keys of the top-level mapping whose value carries a YAML anchor (`key: &name value`)."""
    keys: list[str] = []
    depth = 0  # 1 = inside the top-level mapping
    expect_key = True
    key: str | None = None
    for event in yaml.parse(text, Loader=SAFE_LOADER):
        opens = isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
        closes = isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent))
        if depth == 1 and not closes:
            if expect_key:
                key = event.value if isinstance(event, yaml.ScalarEvent) else None
            elif key is not None and getattr(event, "anchor", None) and not isinstance(event, yaml.AliasEvent):
                keys.append(key)
            expect_key = not expect_key
        if opens:
            depth += 1
        elif closes:
            depth -= 1
    return tuple(keys)


def load_translated(cls: type, path: str | Path, overrides: list[str] | None = None, section: str = "") -> Translated:
    """Read the YAML file, translate it into our spelling, then apply `overrides` (either spelling; they win).

    `section`: translate only that part of the file (e.g. `data` with `cls` = the data section).
    """
    raw = load_yaml(path)
    anchored = _anchored_top_level_keys(Path(path).read_text(encoding="utf-8")) if not section else ()
    part = raw.get(section) if section else raw
    out = translate(cls, part, section, anchored=anchored)
    if not isinstance(out.data, dict):
        if not overrides:
            return out
        out.data = {}
    for text in overrides or []:
        parts, value = parse_override(text)
        if section:
            if parts[: len(section.split("."))] != section.split("."):
                continue
            parts = parts[len(section.split(".")) :]
        marker = _Marker()
        located = translate(cls, _nested(parts, marker), section)
        where = _find(located.data, marker)
        if where is None:  # an ignored key (or one that only leads to ignored keys)
            out.ignored += located.ignored
            continue
        valued = translate(cls, _nested(parts, value), section)
        out.ignored += valued.ignored
        out.renamed += located.renamed
        if not isinstance(value, dict):
            node: Any = valued.data
            for part in where:
                node = node[part]
            _set(out.data, where, node, text)
            for leaf, leaf_value in _leaves(valued.data):  # the other keys a `Translate` sets from the same value
                if leaf[: len(where)] != where:
                    _set(out.data, leaf, leaf_value, text)
            continue
        for leaf, leaf_value in _leaves(valued.data):  # a mapping value sets each of its keys, wherever they went
            _set(out.data, leaf, leaf_value, text)
    return out
