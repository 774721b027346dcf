"""Strict, typed configuration sections shared by every mmfsdp package.

A section is a `@dataclass(kw_only=True, slots=True)` whose fields carry their
defaults and whose `__post_init__` raises `ConfigError(key, message)` for a bad
value. `build(cls, data, path)` turns a YAML mapping into that dataclass,
recursing into nested dataclass fields, and every error it raises names the full
key path (`parallel.fsdp_plan.param_dtype: 'bf32' is not one of ...`).

A section may also accept keys of another framework's schema (`foreign_keys`:
aliases, ignored keys with their reason); `load_translated` rewrites a file into
our spelling before `build` sees it (`mmfsdp.config.foreign`).
"""

from mmfsdp.config.log import current_rank, get_logger, warn_once
from mmfsdp.config.registry import Registry, installed_entry_points
from mmfsdp.config.core import (
    ConfigError,
    ConfigErrors,
    apply_overrides,
    build,
    load_yaml,
    parse_override,
    to_dict,
    dump_yaml,
)
from mmfsdp.config.foreign import Alias, ForeignKey, Ignored, Translate, Translated, foreign_entries, load_translated, translate

__all__ = ["Alias", "ForeignKey", "Ignored", "Translate", "Translated", "foreign_entries", "load_translated", "translate", "Registry", "installed_entry_points", "current_rank", "get_logger", "warn_once", "ConfigError", "ConfigErrors", "apply_overrides", "build", "load_yaml", "parse_override", "to_dict", "dump_yaml"]
