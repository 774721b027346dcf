"""Generic code names no model family: outside `families/` folders, no module of `packages/*/src` or
`apps/train/src` holds a family's name in an identifier, an import, or a key / default string (a string constant
without spaces), nor a module name of a family's LoRA presets (`ModelEntry.lora_presets`: each family declares its
own; `mmfsdp.model.lora` knows none). Docstrings, comments and messages (strings with spaces) may still name one as
an example. A family is one folder under `mmfsdp.model.families` and one under `mmfsdp.data.families`
(docs/families.md)."""

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("packages/*/src")), ROOT / "apps" / "train" / "src"]
FAMILY = re.compile(r"mistral|pixtral|qwen|llava", re.IGNORECASE)

# (file relative to ROOT, the exact name or string): names that are other tools' keywords, not our families.
ALLOWED = {
    # transformers' own `AutoTokenizer.from_pretrained` keyword, passed through as the YAML key of the same name
    ("packages/data/src/mmfsdp/data/config.py", "fix_mistral_regex"),
    ("packages/data/src/mmfsdp/data/processor.py", "fix_mistral_regex"),
    # a transformers module every processor's tokenizer-class check imports (any family's), preloaded before forking
    ("apps/train/src/mmfsdp/train/cli.py", "transformers.tokenization_mistral_common"),
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


def _offences(
    text: str, rel: str, found_in: Callable[[str], bool] = FAMILY.search, *, identifiers: bool = True
) -> list[str]:
    """`rel:line: name` for each identifier (unless not `identifiers`) or key string of `text` (the source of file
    `rel`) outside docstrings and messages that `found_in` flags (by default: a family name)."""
    docstrings = _docstrings(ast.parse(text))
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME:
            if not identifiers:
                continue
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
        if found_in(value) and (rel, value) not in ALLOWED:
            found.append(f"{rel}:{token.start[0]}: {value}")
    return found


def _generic_sources() -> list[tuple[str, str]]:
    """(path relative to ROOT, text) of every module outside `families/` folders."""
    return [
        (path.relative_to(ROOT).as_posix(), path.read_text())
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        if "families" not in path.relative_to(source).parts
    ]


def test_generic_code_names_no_family():
    offences = [offence for rel, text in _generic_sources() for offence in _offences(text, rel)]
    assert not offences, "family names outside families/ folders:\n" + "\n".join(offences)


def _lora_preset_names() -> set[str]:
    """Every leaf name and module pattern of every registered family's LoRA presets (LLaVA's included)."""
    import families.llava  # noqa: F401  (registers the test-only family)
    from mmfsdp.model import get_model_entry, registered_model_ids

    return {
        name
        for model_id in registered_model_ids()
        for names in get_model_entry(model_id).lora_presets.values()
        for name in names
    }


def test_lora_presets_live_in_their_family():
    """No generic module spells a module name of a family's LoRA presets in a key string; each family declares its
    own. (Identifiers may: the Gated DeltaNet operator reads `module.in_proj_qkv`.)"""
    names = _lora_preset_names()
    assert {"q_proj", "in_proj_qkv", "model.visual.blocks.{*}.attn.qkv"} <= names  # the presets are declared

    def names_a_preset_module(value: str) -> bool:
        return any(name in value for name in names)

    offences = [
        offence
        for rel, text in _generic_sources()
        for offence in _offences(text, rel, names_a_preset_module, identifiers=False)
    ]
    assert not offences, "LoRA preset module names outside families/ folders:\n" + "\n".join(offences)


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
    presets = 'PRESETS = {"attention": ("q_proj", "k_proj")}\nMESSAGE = "e.g. q_proj or k_proj"\nq_proj = 1\n'
    found = _offences(presets, "probe.py", lambda value: "q_proj" in value, identifiers=False)
    assert found == ["probe.py:1: q_proj"]
