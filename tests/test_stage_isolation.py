"""One objective per stage (CONVENTIONS.md, "Stages are objectives"): what differs between training stages lives
in the stage's objective class (`mmfsdp.train.objective`, one module per stage beside it), looked up by name in `mmfsdp.train.stages`; the trainer,
config checks, memory plan, evaluator and checkpoints ask it.

An AST scan of every source module of packages/ and apps/ finds code outside the objectives' module that branches on
a stage: a comparison with `.stage` / `stage` on either side (`t.stage == "dpo"`, `t.stage in ("sft", "dpo")`,
`stage != t.stage`), a `match` on it, a dict literal indexed by it, or its truth value as a condition.
"""

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("packages/*/src")), *sorted(ROOT.glob("apps/*/src"))]
OBJECTIVE_MODULES = {ROOT / "apps/train/src/mmfsdp/train/objective.py"}
"""The modules that may branch on a stage: the objectives themselves."""


def _is_stage(node: ast.AST) -> bool:
    """`x.stage`, a name `stage`, or `getattr(x, "stage")`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "stage"
    if isinstance(node, ast.Name):
        return node.id == "stage"
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "stage"
    )


def stage_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place `source` branches on a stage (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_is_stage, [node.left, *node.comparators])):
            found.append((node.lineno, "compares a stage"))
        elif isinstance(node, ast.Match) and _is_stage(node.subject):
            found.append((node.lineno, "matches on a stage"))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and _is_stage(node.slice):
            found.append((node.lineno, "indexes a dict literal by a stage"))
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) and _is_stage(node.test):
            found.append((node.lineno, "tests a stage's truth value"))
        elif isinstance(node, ast.BoolOp) and any(map(_is_stage, node.values)):
            found.append((node.lineno, "tests a stage's truth value"))
    return found


def _modules() -> list[Path]:
    return sorted(path for source in SOURCES for path in source.rglob("*.py"))


def test_only_the_objectives_branch_on_the_stage():
    modules = _modules()
    assert any(path.name == "trainer.py" for path in modules) and OBJECTIVE_MODULES <= set(modules)
    offences = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in modules if path not in OBJECTIVE_MODULES
        for line, what in stage_branches(path.read_text())
    ]
    assert not offences, (
        "stage-specific code outside the objectives (move it into the stage's objective class, "
        "mmfsdp.train.objective, and ask it through mmfsdp.train.stages):\n" + "\n".join(offences)
    )


@pytest.mark.parametrize(
    "code",
    [
        'if cfg.training.stage == "dpo":\n    pass',
        'sequences = 2 if t.stage == "dpo" else 1',
        'ok = "sft" != t.stage',
        'ok = t.stage in ("sft", "dpo")',
        "if stage != t.stage:\n    pass",
        'ok = getattr(t, "stage") == "dpo"',
        "match t.stage:\n    case 'dpo':\n        pass",
        'n = {"sft": 1, "dpo": 2}[t.stage]',
        "x = t.stage and 1",
        "if t.stage:\n    pass",
    ],
)
def test_the_scan_finds_a_branch_on_the_stage(code):
    assert stage_branches(textwrap.dedent(code)), code


@pytest.mark.parametrize(
    "code",
    [
        "cls = STAGES[t.stage]",
        "objective = objective_class(t.stage).build(context)",
        'message = f"a {stage} checkpoint, this run is {t.stage}"',
        'metadata = {"stage": cls.stage}',
        'ok = t.stages == "dpo"',
    ],
)
def test_the_scan_leaves_lookups_and_messages_alone(code):
    assert not stage_branches(code), code
