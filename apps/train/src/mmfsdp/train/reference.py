"""The configuration reference, generated from the section dataclasses themselves.

Every field's one-line docstring (the string literal under it) is read from the
class source with `ast`, so `docs/configuration.md` lists every key with its
type and default, and a test keeps the file in step with the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, get_type_hints

from mmfsdp.config.core import _type_name


def field_docs(cls: type) -> dict[str, str]:
    """Field name → the docstring literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else value
    return "(required)"


def _fmt_default(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value!r}`" if value else "`''`"
    return f"`{value!r}`"


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key path, type, default, description) for every leaf field under `cls`, depth first."""
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    out: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.append((path, "section", "", docs.get(f.name, "")))
            out.extend(rows(tp, path))
        else:
            out.append((path, _type_name(tp), _fmt_default(_default(f)), docs.get(f.name, "")))
    return out


def missing_docs(cls: type, prefix: str = "") -> list[str]:
    return [path for path, _, _, doc in rows(cls, prefix) if not doc]


def render(root: type) -> str:
    lines = [
        "# Configuration reference",
        "",
        "One YAML file with six sections. Every key below can also be set on the command line after the",
        "config path as `section.key=value` (the value is read as YAML), e.g.",
        "`uv run apps/train my.yaml training.lr=1e-5 parallel.ulysses_parallel_size=2`.",
        "Unknown keys, wrong types and impossible combinations are errors naming the key path, before any",
        "process starts. This file is generated from the code: `uv run python tools/gen_config_reference.py`.",
        "",
    ]
    hints = get_type_hints(root)
    docs = field_docs(root)
    for f in dataclasses.fields(root):
        lines += [f"## `{f.name}`", "", docs.get(f.name, ""), "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        for path, tp, default, doc in rows(hints[f.name], f.name):
            tp_cell = tp.replace("|", "\\|")
            lines.append(f"| `{path}` | {tp_cell} | {default.replace('|', chr(92) + '|')} | {doc.replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)
