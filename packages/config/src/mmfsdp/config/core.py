"""Dataclass-from-mapping builder with key-path errors, typo hints and dotted overrides."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A user's configuration mistake: `key` is the dotted path, `message` says what is wrong."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with `prefix` put in front of its key path."""
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


class ConfigErrors(ConfigError):
    """Several configuration mistakes found together; `errors` lists each one (report one line each)."""

    def __init__(self, errors: list[ConfigError]):
        assert errors, "ConfigErrors needs at least one error"
        self.errors = list(errors)
        super().__init__(errors[0].key, errors[0].message)
        self.args = ("\n".join(str(e) for e in self.errors),)

    def __str__(self) -> str:
        return self.args[0]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return repr(tp).replace("typing.", "")
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", repr(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against annotation `tp`, converting where YAML is looser than Python."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return build(tp, value, path)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            hint = ""
            if isinstance(value, str):
                close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, f"{value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _convert(arg, value, path)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(path, f"expected null, got {value!r}")
        return None
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        return [_convert(item_tp, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(key_tp, k, path): _convert(val_tp, v, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML 1.1 reads "1e-5" as a string
                except ValueError:
                    pass
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
        return value
    return value


def build(cls: type, data: dict[str, Any] | None, path: str = "") -> Any:
    """Build dataclass `cls` from `data`, strictly: unknown keys and wrong types are `ConfigError`s."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {data!r}")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            # a near miss may be a key of another schema the section accepts (`foreign_keys`, mmfsdp.config.foreign)
            foreign = [k.split(".")[0] for k in getattr(cls, "foreign_keys", {}) or {}]
            close = difflib.get_close_matches(str(key), list(fields) + foreign, n=1, cutoff=0.6)
            hint = f" (did you mean '{_join(path, close[0])}'?)" if close else ""
            valid = ", ".join(fields)
            raise ConfigError(_join(path, str(key)), f"unknown key{hint}; valid keys here: {valid}")
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(path) from None


def to_dict(obj: Any) -> Any:
    """A plain YAML-ready structure of a (nested) config dataclass."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints` of a config section class, resolved once per class (the annotations are strings:
    resolving them is most of what reading a config costs). Read-only: the same dict is returned every time."""
    return get_type_hints(cls)


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML was built with it (its wheels are), with the safe constructor: the same values as
`yaml.safe_load`, about ten times faster (every rank of every run reads its config)."""
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
"""libyaml's emitter with the safe representer: `yaml.safe_dump`'s text, faster."""


def safe_load(text: str) -> Any:
    """`yaml.safe_load` through `SAFE_LOADER`."""
    return yaml.load(text, Loader=SAFE_LOADER)


def safe_dump(value: Any, **options: Any) -> str:
    """`yaml.safe_dump` through `SAFE_DUMPER`."""
    return yaml.dump(value, Dumper=SAFE_DUMPER, **options)


def dump_yaml(obj: Any) -> str:
    return safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.lr=1e-5` -> (['training', 'lr'], 1e-05); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError("", f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError("", f"override {text!r} has an empty key")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot read override value {raw!r}: {err}") from None
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in "eE.") and value.lstrip("+-")[:1].isdigit() else value
        except ValueError:
            pass
    return parts, value


def parent_section(data: dict[str, Any], parts: tuple[str, ...] | list[str], what: str, prefix: str = "") -> dict[str, Any]:
    """The mapping that holds key `parts[-1]` under `data`, creating missing sections on the way; a non-mapping
    on the way is a `ConfigError` at its key path (`prefix` + the parts so far) saying `what` could not go under it."""
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            path = ".".join(parts[: i + 1])
            raise ConfigError(f"{prefix}.{path}" if prefix else path, f"is {child!r}, not a section, so {what} cannot go under it")
        node = child
    return node


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b.c=value` in the nested mapping `data` (in place) and return it."""
    for text in overrides:
        parts, value = parse_override(text)
        parent_section(data, parts, repr(text))[parts[-1]] = value
    return data


def load_yaml(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config file into a mapping and apply dotted overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"config file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("", f"config file {str(path)!r} is not a UTF-8 text file (byte {err.start} is {err.object[err.start:err.start + 1]!r}); pass a YAML config") from None
    try:
        data = safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError("", f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError("", f"config file {str(path)!r} nests too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return apply_overrides(data, overrides or [])

