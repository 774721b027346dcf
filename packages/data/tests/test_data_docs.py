"""docs/data.md documents every key of the `data:` section and every bad-row reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_type_hints

from mmfsdp.data import BAD_REASONS, DataConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def _leaves(cls: type, path: str):
    """(dotted path, table name) of every non-section field; table name is how the row starts in the doc."""
    hints = get_type_hints(cls)
    for name, tp in ((f.name, hints[f.name]) for f in dataclasses.fields(cls)):  # fields only: not `foreign_keys`
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{path}.{name}")
        else:
            yield f"{path}.{name}", name


def test_every_key_and_reason_is_documented():
    text = DOC.read_text()
    missing = [
        dotted
        for dotted, name in _leaves(DataConfig, "data")
        if f"| `{name}` |" not in text and f"| `{dotted.split('.')[-2]}.{name}` |" not in text
    ]
    assert not missing, missing
    assert all(f"| `{reason}` |" in text for reason in BAD_REASONS)
