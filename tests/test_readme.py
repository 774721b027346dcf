"""The README is a front door: short, and its test count and time are measured (`tools/suite_timings.py`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 120


def _suite_timings():
    spec = importlib.util.spec_from_file_location("suite_timings", ROOT / "tools" / "suite_timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}: details go to docs/)"


def test_readme_suite_block_is_the_measured_one():
    tool = _suite_timings()
    summary = json.loads(tool.SUMMARY.read_text())
    assert "full" in summary, "run tools/suite_timings.py (and --tier quick)"
    text = (ROOT / "README.md").read_text()
    start, end = text.index(tool.BLOCK_START), text.index(tool.BLOCK_END) + len(tool.BLOCK_END)
    assert text[start:end] == tool.render_block(summary)
    assert summary["full"]["tests"] > summary.get("quick", {"tests": 0})["tests"] >= 0


def test_closing_counts_and_render(tmp_path):
    tool = _suite_timings()
    assert tool.closing_counts("==== 1079 passed, 1 skipped, 2 warnings in 556.12s (0:09:16) ====") == {
        "passed": 1079, "skipped": 1}
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{tool.BLOCK_START}\nold\n{tool.BLOCK_END}\nb\n")
    summary = {"full": {"tests": 3, "wall_s": 61.4, "date": "2026-12-06", "cpu": "X, 2 cores"}}
    tool.rewrite_readme(summary, readme)
    assert readme.read_text() == f"a\n{tool.render_block(summary)}\nb\n"
    assert "3 tests in 1 min 01 s on X, 2 cores (2026-12-06" in tool.render_block(summary)
