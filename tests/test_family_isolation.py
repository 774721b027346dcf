"""Generic code names no model family: outside `families/` folders, no module of `packages/*/src` or
`apps/train/src` holds a family's name in an identifier, an import, or a key / default string (a string constant
without spaces). Docstrings, comments and messages (strings with spaces) may still name one as an example.
A family is one folder under `mmfsdp.model.families` and one under `mmfsdp.data.families` (docs/families.md)."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("packages/*/src")), ROOT / "apps" / "train" / "src"]
FAMILY = re.compile(r"mistral|pixtral|qwen|llava", re.IGNORECASE)

# (file relative to ROOT, the exact name or string): names that are other tools' keywords, not our families.
ALLOWED = {
    # transformers' own `AutoTokenizer.from_pretrained` keyword, passed through as the YAML key of the same name
    ("packages/data/src/mmfsdp/data/config.py", "fix_mistral_regex"),
    ("packages/data/src/mmfsdp/data/processor.py", "fix_mistral_regex"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """Line numbers where a docstring starts (module, class, function, and attribute docstrings)."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.add(stmt.lineno)
    return lines


def _offences(text: str, rel: str) -> list[str]:
    """`rel:line: name` for each family name in `text` (the source of file `rel`) outside docstrings and messages."""
    docstrings = _docstrings(ast.parse(text))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME:
            value = token.string
        elif token.type == tokenize.STRING and token.start[0] not in docstrings:
            value = ast.literal_eval(token.string) if not re.match(r"^[a-zA-Z]*[fF]", token.string) else token.string
            if not isinstance(value, str) or re.search(r"\s", value):
                continue  # a message: it may give a family as an example
        elif token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            value = token.string
            if re.search(r"\s", value):
                continue
        else:
            continue
        if FAMILY.search(value) and (rel, value) not in ALLOWED:
            found.append(f"{rel}:{token.start[0]}: {value}")
    return found


def test_generic_code_names_no_family():
    offences = []
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            if "families" not in path.relative_to(source).parts:
                offences += _offences(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not offences, "family names outside families/ folders:\n" + "\n".join(offences)


def test_the_scan_finds_a_family_name():
    """The scan itself: an identifier, an import and a key are found; a docstring, a comment and a message are not."""
    source = (
        '"""Mistral in a docstring."""\n'
        "# pixtral in a comment\n"
        "from transformers import LlavaConfig\n"
        'DEFAULT = "qwen3_vl"\n'
        'MESSAGE = "set it to qwen3_vl or mistral"\n'
    )
    assert _offences(source, "probe.py") == ["probe.py:3: LlavaConfig", "probe.py:4: qwen3_vl"]
