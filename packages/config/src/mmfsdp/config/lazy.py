"""Names of a package that load on first use (PEP 562), shared by the packages whose imports are heavy."""

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, table: Mapping[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """Return the `__getattr__` and `__dir__` of `package`, whose names in `table` (name -> module) import
    their module when first read; the value is then cached in `namespace` (the package's `globals()`)."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
