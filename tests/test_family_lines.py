"""docs/families.md's line-count table ("How big a family is") is what the folders hold now.

`family_table()` writes the table: one row per installed model family (entry-point group `mmfsdp.model_families`;
not the test-only LLaVA family), its own files and their lines. A family's own files are its model folder (`mmfsdp.model.families.<id>`, the module of its spec) and
the data folder where its declared data pieces live (the folder of the module that registers its default template),
unless it inherits its `data` declaration from the spec it subclasses (the MoE families take their dense family's
data folder, which that family's row counts). `lines` are physical lines (`wc -l`); `code lines` leave out blank
lines, comment lines and docstrings. What a family builds on (the shared modules, a family it subclasses) is not
counted. Regenerate the table with `uv run python tests/test_family_lines.py` and paste it between the markers.
"""

from __future__ import annotations

import ast
import importlib
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "families.md"
BEGIN = "<!-- family-lines: `uv run python tests/test_family_lines.py` writes this table -->"
END = "<!-- /family-lines -->"
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def line_counts(text: str) -> tuple[int, int]:
    """(physical lines, code lines) of Python source `text`: code lines hold a token that is not a comment and lie
    outside every docstring (a string statement: module, class, function or attribute docstring)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    physical = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return physical, len(code - docstrings)


def family_folders(model_id: str) -> list[tuple[str, Path]]:
    """("model" / "data", folder) of the family's own folders (module docstring)."""
    from mmfsdp.model import get_model_entry

    entry = get_model_entry(model_id)
    spec = type(entry)
    folders = [("model", Path(sys.modules[spec.__module__].__file__).parent)]
    declares_data = any("data" in vars(cls) for cls in spec.__mro__ if cls.__module__ == spec.__module__)
    if declares_data and entry.data.templates:
        from mmfsdp.data.templates import get_template

        template_module = importlib.import_module(get_template(entry.data.templates[0]).__module__)
        folders.append(("data", Path(template_module.__file__).parent))
    return folders


def family_table() -> str:
    """The markdown table of every installed family's own files and lines, between the markers."""
    from importlib.metadata import entry_points

    from mmfsdp.model.registry import FAMILY_ENTRY_POINT_GROUP

    rows = ["| family | its own files (lines each) | lines | code lines |", "| --- | --- | ---: | ---: |"]
    totals = [0, 0]
    for model_id in sorted(point.name for point in entry_points(group=FAMILY_ENTRY_POINT_GROUP)):
        cells, lines, code = [], 0, 0
        for kind, folder in family_folders(model_id):
            files = []
            for path in sorted(folder.glob("*.py")):
                physical, code_lines = line_counts(path.read_text())
                files.append(f"`{path.name}` ({physical})")
                lines, code = lines + physical, code + code_lines
            cells.append(f"{kind} `families/{folder.name}/`: {', '.join(files)}")
        rows.append(f"| `{model_id}` | {'; '.join(cells)} | {lines} | {code} |")
        totals = [totals[0] + lines, totals[1] + code]
    rows.append(f"| all | | {totals[0]} | {totals[1]} |")
    return "\n".join([BEGIN, *rows, END])


def test_the_docs_table_counts_the_folders_as_they_are():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} has no family-lines table"
    documented = text[text.index(BEGIN) : text.index(END) + len(END)]
    stale = "docs/families.md's table is stale: run `uv run python tests/test_family_lines.py` and paste it"
    assert documented == family_table(), stale


def test_line_counts_leave_out_docstrings_comments_and_blank_lines():
    source = (
        '"""Module\ndocstring."""\n\n# a comment\nX = 1  # code\n\n\n'
        'def f():\n    """Doc."""\n    return """a\nb"""\n'
    )
    assert line_counts(source) == (11, 4)  # X, def, return and the string's second line


if __name__ == "__main__":
    print(family_table())
