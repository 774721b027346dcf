"""No Python file of the tree is over `MAX_LINES` lines: a longer module holds more than one concept (split it by
concept, as `mmfsdp.data.dataset` and `tools/bench/gpu_check.py` were), a longer test file more than one subject.

Counted: every `.py` file git tracks under packages/, apps/, tools/, tests/ and examples/ (every one found there when
the tree is not a git checkout), in physical lines (`wc -l`).
"""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
AREAS = ("packages", "apps", "tools", "tests", "examples")


def python_files() -> list[Path]:
    """The `.py` files of `AREAS`: git's tracked ones, or all of them outside a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *(f"{area}/*.py" for area in AREAS)],
            cwd=ROOT, capture_output=True, check=True, text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(path for area in AREAS for path in (ROOT / area).rglob("*.py"))
    return [ROOT / name for name in listed.split("\0") if name]


def line_count(path: Path) -> int:
    """Physical lines, as `wc -l` counts them (a last line without a newline counts too)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def test_no_python_file_is_over_the_limit():
    files = python_files()
    assert len(files) > 100 and ROOT / "tools" / "bench" / "gpu_check.py" in files
    too_long = {path.relative_to(ROOT).as_posix(): n for path in files if (n := line_count(path)) > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines (split by concept): {too_long}"
