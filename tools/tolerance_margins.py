"""How close each parity test comes to its tolerance on this machine: the margins table of docs/testing.md.

    uv run python tools/tolerance_margins.py                     # the parity tests (PARITY below), 2 workers
    uv run python tools/tolerance_margins.py -- -n 0 tests/test_dpo_trl.py   # pytest arguments after `--`
    uv run python tools/tolerance_margins.py --from margins.jsonl  # summarise earlier records, run nothing
    uv run python tools/tolerance_margins.py --smoke              # one small file (CI's check that the tool works)

It runs pytest (in this process) with `MMFSDP_RECORD_MARGINS` set: every numeric parity check of the suite
(`mmfsdp.parallel.testing.record_margin`, through `assert_within`, `mmfsdp.model.testing.assert_close` and the end
to end tests' `apprun.close`) appends its measured relative difference and its bound there. It prints the machine
(the CPU's model name, the platform, torch's version), then per test its tightest check, the lowest margin
(tolerance / measured difference) first, and last one JSON object: the CPU, pytest's exit code, the numbers of
records and tests, and the ten tightest tests with their margins. A margin under 5 on a comparison of two different
kernels is what docs/testing.md ("Tolerances and their margins") asks to look at: align the kernels or bound the
comparison by the measured fp32 noise. `--out` keeps the records (appended to, so several batches add up);
a margin below 1 on a passing test is a check that also accepts another criterion (an absolute bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARGINS_ENV = "MMFSDP_RECORD_MARGINS"  # read by mmfsdp.parallel.testing.record_margin
PARITY = [
    "packages/model/tests",
    "packages/parallel/tests",
    "packages/data/tests/test_data_video_model.py",
    "packages/data/tests/test_data_packing_isolation.py",
    "tests/test_dpo_trl.py",
    "tests/test_e2e_family_contract.py",
    "tests/test_e2e_qwen3_5.py",
    "tests/test_e2e_cp.py",
    "tests/test_e2e_lora.py",
    "tests/test_e2e_moe_router.py",
    "tests/test_e2e_fsdp_parity.py",
    "tests/test_e2e_qwen3vl_parity.py",
    "tests/test_e2e_qwen3_5_parity.py",
    "tests/test_e2e_qwen3omni_parity.py",
    "tests/test_e2e_text_only_parity.py",
    "tests/test_e2e_varlen_parity.py",
    "tests/test_e2e_video_parity.py",
    "tests/test_e2e_dpo_parity.py",
    "tests/test_e2e_compile.py",
]
"""The default run: the files whose tests compare two computations numerically (about 15 CPU-minutes)."""
SMOKE_ARGS = ["-n", "0", "packages/model/tests/test_model_sequence_loss.py"]
TIGHTEST = 10


def machine() -> dict[str, str]:
    """The CPU's model name (/proc/cpuinfo, else `platform.processor()`), the platform and torch's version."""
    import torch

    from mmfsdp.parallel.peak import processor_name

    return {"cpu": processor_name(), "platform": platform.platform(),
            "torch": torch.__version__, "cores": str(os.cpu_count())}


def margin(diff: float, tol: float) -> float:
    """tol / diff: how many times the measured difference fits under its bound (inf where it is 0)."""
    if math.isnan(diff):
        return 0.0
    return math.inf if diff == 0 else tol / diff


def tightest_per_test(records: list[dict]) -> list[dict]:
    """Each test's record of the lowest margin, with `margin` and `checks` (its number of records); lowest first."""
    per_test: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for record in records:
        row = {**record, "margin": margin(record["diff"], record["tol"])}
        test = record["test"]
        counts[test] = counts.get(test, 0) + 1
        if test not in per_test or row["margin"] < per_test[test]["margin"]:
            per_test[test] = row
    rows = [{**row, "checks": counts[test]} for test, row in per_test.items()]
    return sorted(rows, key=lambda row: (row["margin"], row["test"]))


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict], top: int) -> str:
    lines = [f"{'margin':>9} {'diff':>9} {'tol':>8} {'checks':>6}  test  [tightest check]"]
    for row in rows[:top]:
        shown = "inf" if math.isinf(row["margin"]) else f"{row['margin']:.3g}"
        lines.append(f"{shown:>9} {row['diff']:>9.3g} {row['tol']:>8.3g} {row['checks']:>6}  {row['test']}  [{row['what']}]")
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more tests, all with larger margins")
    return "\n".join(lines)


def _pytest(pytest_args: list[str], records: Path) -> int:
    """pytest with `pytest_args` from the repository root, recording margins to `records`: in this process (its
    interpreter start and imports already paid; xdist workers, when the arguments ask for them, inherit the
    variable), the working directory and the variable restored after."""
    import pytest

    cwd, previous = os.getcwd(), os.environ.get(MARGINS_ENV)
    os.environ[MARGINS_ENV] = str(records)
    os.chdir(ROOT)
    try:
        return int(pytest.main(list(pytest_args)))
    finally:
        os.chdir(cwd)
        if previous is None:
            os.environ.pop(MARGINS_ENV, None)
        else:
            os.environ[MARGINS_ENV] = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/tolerance_margins.py",
        description="Run parity tests with MMFSDP_RECORD_MARGINS set and print, per test, how close its tightest "
        "check comes to its tolerance on this machine (lowest margin first).",
    )
    parser.add_argument("--out", type=Path, help="keep the records in this JSON-lines file (appended to)")
    parser.add_argument("--from", dest="source", type=Path, help="summarise this records file; run no tests")
    parser.add_argument("--top", type=int, default=30, help="rows of the table (default 30)")
    parser.add_argument("--smoke", action="store_true", help=f"run only `{' '.join(SMOKE_ARGS)}`")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest after `--` (default: the PARITY files)")
    args = parser.parse_args(argv)
    code, wall = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.source or (args.out.resolve() if args.out else Path(tmp) / "margins.jsonl")
        if args.source is None:
            pytest_args = SMOKE_ARGS + args.pytest_args if args.smoke else (args.pytest_args or PARITY)
            started = time.perf_counter()
            code = _pytest(pytest_args, path)
            wall = time.perf_counter() - started
        records = read_records(path)
    rows = tightest_per_test(records)
    where = machine()
    print(f"\ncpu: {where['cpu']} ({where['cores']} cores)  platform: {where['platform']}  torch: {where['torch']}")
    print(table(rows, args.top))
    tightest = [{key: row[key] for key in ("test", "what", "diff", "tol")}
                | {"margin": None if math.isinf(row["margin"]) else round(row["margin"], 3)} for row in rows[:TIGHTEST]]
    print(json.dumps({"cpu": where["cpu"], "torch": where["torch"], "pytest_exit": code, "wall_s": round(wall, 1),
                      "records": len(records), "tests": len(rows), "tightest": tightest}))
    return 0 if code == 0 and records else 1


if __name__ == "__main__":
    raise SystemExit(main())
