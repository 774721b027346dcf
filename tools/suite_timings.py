"""Measure the test suite's seconds per file and write the table the suite is scheduled by.

    uv run python tools/suite_timings.py                 # the whole suite as CI runs it; writes tests/file_seconds.json
    uv run python tools/suite_timings.py -- -m "not slow"  # pytest arguments after `--`
    uv run python tools/suite_timings.py --smoke         # one small test file, the table to a temporary file

It runs `python -m pytest` (the suite's own options from pyproject.toml: two xdist workers taking whole files) with
`MMFSDP_RECORD_FILE_SECONDS` set, so the root conftest.py sums every test's setup, call and teardown seconds per
file and writes them out. conftest.py collects files longest first from that table, so the slowest files start
first and the two workers finish together. The last line printed is one JSON object: the wall time, pytest's exit
code, the number of files, the summed seconds and the five longest files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "file_seconds.json"
RECORD_ENV = "MMFSDP_RECORD_FILE_SECONDS"  # read by the root conftest.py
SMOKE_ARGS = ["-n", "0", "tests/test_import_graph.py"]


def measure(pytest_args: list[str], out: Path) -> tuple[int, float, dict[str, float]]:
    """Run pytest with `pytest_args`, recording seconds per file into `out`; (exit code, wall s, table)."""
    env = {**os.environ, RECORD_ENV: str(out)}
    started = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    table = json.loads(out.read_text()) if out.is_file() else {}
    return code, wall, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/suite_timings.py",
        description="Run the test suite and write its measured seconds per file (tests/file_seconds.json), "
        "which conftest.py orders the files by (longest first).",
    )
    parser.add_argument("--out", type=Path, default=TABLE, help=f"where to write the table (default: {TABLE.relative_to(ROOT)})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"run only `{' '.join(SMOKE_ARGS)}` and write the table to a temporary file (CI's check that the tool works)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest after `--` (default: none, the whole suite)")
    args = parser.parse_args(argv)
    pytest_args = list(args.pytest_args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "file_seconds.json" if args.smoke else args.out.resolve()
        if args.smoke:
            pytest_args = SMOKE_ARGS + pytest_args
        code, wall, table = measure(pytest_args, out)
    top = dict(list(table.items())[:5])
    print(json.dumps({"wall_s": round(wall, 1), "pytest_exit": code, "files": len(table),
                      "sum_s": round(sum(table.values()), 1), "longest": top, "written": None if args.smoke else str(out)}))
    return 0 if code == 0 and table else 1


if __name__ == "__main__":
    raise SystemExit(main())
