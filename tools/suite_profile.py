"""Where the test suite's CPU goes: every Python process of a pytest run sampled, charged to its test.

    uv run python tools/suite_profile.py                          # the whole suite as CI runs it (~13 min here)
    uv run python tools/suite_profile.py -- -n 0 tests/test_e2e_resume.py   # pytest arguments after `--`
    uv run python tools/suite_profile.py --from DIR --focus test_e2e_compile  # report on kept samples, one file
    uv run python tools/suite_profile.py --smoke                  # one small file (CI's check that the tool works)

It runs `python -m pytest` with `tools/suite_profile/` first on `PYTHONPATH`, so every Python process the run
starts (test workers, the forkservers and the ranks they fork, the app's launchers and ranks, scripts, exec'd
`torchrun` ranks) loads its `sitecustomize.py`: a SIGPROF timer on the process's own CPU time that counts the stack
it interrupts (weighed by the process's CPU time since its previous sample), tagged with the running test (`PYTEST_CURRENT_TEST`, inherited by ranks and scripts). A timer per
process, not one sampler of the machine: a rank's seconds are charged to its test whatever the other worker runs.
C code counts for the Python frame that called it (a long C call is one sample, weighed by its CPU time). Processes outside the workspace's Python (the vLLM server, if
its environment drops `PYTHONPATH`) and samples not yet written when a process is killed are missed: the report
prints the machine's busy CPU-seconds over the run beside the sampled ones.

Printed: CPU-seconds per test file, the functions with the most samples of their own (self) and including their
callees (cumulative), for all samples or those of `--focus` (a substring of the test id). The last line is one JSON
object: pytest's exit code, the run's wall and busy CPU-seconds, the sampled ones, and the top files and
functions. The sampler changes timings a little (~2 % more CPU) and a test that stops processes with SIGSTOP may
fail under it; use the numbers to find costs, `tools/suite_timings.py` to measure the suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLER_DIR = Path(__file__).resolve().with_name("suite_profile")
SMOKE_ARGS = ["-n", "0", "tests/test_import_graph.py"]
DIR_ENV, INTERVAL_ENV = "MMFSDP_SUITE_PROFILE_DIR", "MMFSDP_SUITE_PROFILE_INTERVAL"


def _busy_seconds() -> float:
    """The machine's CPU-seconds spent not idle since boot (/proc/stat; 0 where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run(pytest_args: list[str], out: Path, interval: float) -> tuple[int, float, float]:
    """pytest with the sampler in every process; (exit code, wall s, busy CPU-s of the machine)."""
    env = {**os.environ, DIR_ENV: str(out), INTERVAL_ENV: str(interval),
           "PYTHONPATH": os.pathsep.join(p for p in (str(SAMPLER_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    busy, started = _busy_seconds(), time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args], cwd=ROOT,
                           env=env)
    return code, time.perf_counter() - started, _busy_seconds() - busy


def _short(frame: str) -> str:
    for marker in ("site-packages/", f"{ROOT}/"):
        if marker in frame:
            return frame.split(marker, 1)[1]
    return frame


def read(out: Path, focus: str | None):
    """(sampled CPU-s, per file, per script, self, cumulative) from the sample files under `out`."""
    files, scripts, own, cumulative = (collections.Counter() for _ in range(4))
    total = 0.0
    for path in sorted(out.glob("*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            count, _, key = line.partition("\t")
            test, _, rest = key.partition("|")
            script, _, stack = rest.partition("|")
            if not stack or (focus and focus not in test):
                continue
            seconds = int(count) / 1e6
            total += seconds
            files[test.split("::")[0]] += seconds
            scripts[script] += seconds
            frames = [_short(f) for f in stack.split(";")]
            own[frames[-1]] += seconds
            for frame in set(frames):
                cumulative[frame] += seconds
    return total, files, scripts, own, cumulative


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--smoke", action="store_true", help=f"profile {' '.join(SMOKE_ARGS)} only")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="report on the samples kept in this directory (an earlier --keep), run nothing")
    parser.add_argument("--keep", type=Path, default=None, help="write the samples here (default: a temporary "
                        "directory, removed); --from reads them again")
    parser.add_argument("--focus", default=None, help="report only the samples of tests whose id contains this")
    parser.add_argument("--interval", type=float, default=0.02, help="CPU-seconds between samples of a process")
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    parser.add_argument("pytest_args", nargs="*", help="pytest arguments, after `--` (default: the whole suite)")
    args = parser.parse_args(argv)

    code, wall, busy = None, None, None
    with tempfile.TemporaryDirectory(prefix="mmfsdp-suite-profile-") as scratch:
        out = args.source or args.keep or Path(scratch)
        if args.source is None:
            out.mkdir(parents=True, exist_ok=True)
            pytest_args = SMOKE_ARGS if args.smoke else args.pytest_args
            code, wall, busy = run(pytest_args, out, args.interval)
        total, files, scripts, own, cumulative = read(out, args.focus)
    print(f"\nsampled {total:.1f} CPU-s" + (f" of {busy:.1f} busy CPU-s on the machine in {wall:.0f} s"
                                           if busy is not None else "") + (f" (tests matching {args.focus!r})"
                                                                           if args.focus else ""))
    for title, table in (("CPU-s per test file ('-': no test, e.g. worker start-up)", files),
                         ("CPU-s per process script", scripts), ("self CPU-s per function", own),
                         ("cumulative CPU-s per function (callees included)", cumulative)):
        print(f"\n{title}:")
        for name, seconds in table.most_common(args.top):
            print(f"  {seconds:8.1f}  {name}")
    print(json.dumps({
        "pytest_exit": code, "wall_s": None if wall is None else round(wall, 1),
        "busy_cpu_s": None if busy is None else round(busy, 1), "sampled_cpu_s": round(total, 1),
        "files": [[name, round(s, 1)] for name, s in files.most_common(10)],
        "self": [[name, round(s, 1)] for name, s in own.most_common(10)],
    }))
    return 0 if code in (None, 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
