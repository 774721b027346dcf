"""Strict, typed configuration sections shared by every mmfsdp package.

A section is a `@dataclass(kw_only=True, slots=True)` whose fields carry their
defaults and whose `__post_init__` raises `ConfigError(key, message)` for a bad
value. `build(cls, data, path)` turns a YAML mapping into that dataclass,
recursing into nested dataclass fields, and every error it raises names the full
key path (`parallel.fsdp_plan.param_dtype: 'bf32' is not one of ...`).
"""

from mmfsdp.config.log import current_rank, get_logger, warn_once
from mmfsdp.config.registry import Registry
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

__all__ = ["Registry", "current_rank", "get_logger", "warn_once", "ConfigError", "ConfigErrors", "apply_overrides", "build", "load_yaml", "parse_override", "to_dict", "dump_yaml"]
