"""Suite-wide test set-up: ordering, threads, what distributed test ranks preload, and recording file times.

The suite runs on two xdist workers that take whole files (`-n 2 --dist loadfile`, pyproject.toml), in
collection order. Longest first keeps the end of the run short: files are collected in the order of their
measured seconds (`tests/file_seconds.json`, longest first; every other file follows in its usual order). A wrong
or missing number only changes the order, never what runs. The table is measured, not kept by hand:
`uv run python tools/suite_timings.py` runs the suite with `MMFSDP_RECORD_FILE_SECONDS` set, which makes this
file sum every test's setup, call and teardown seconds per file (on the xdist controller) and write them there.
Two workers already fill the cores, so each test process (and every rank it spawns, which inherits the
environment) computes on one thread unless OMP_NUM_THREADS says otherwise; the app's launcher does the same.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch

from mmfsdp.parallel.testing import preload_for_ranks  # noqa: E402
from mmfsdp.train.cli import RANK_PRELOAD  # noqa: E402

# what the ranks of `run_distributed` import once, in the forkserver they fork from: what the app's launcher
# imports before it forks its ranks, every model family, and what ranks of the suite import besides: pytest (each
# rank loads its test module, which imports it: ~0.35 s a rank), PEFT (LoRA runs) and the pattern matcher that
# AOTAutograd's graph clean-up imports (compiled runs). Measured by sampling every process of the suite: 15, 6
# and 4 CPU-seconds of imports in ranks.
preload_for_ranks(*RANK_PRELOAD, "mmfsdp.model.all_families", "mmfsdp.ckpt", "pytest", "peft",
                  "torch._inductor.pattern_matcher")

FILE_SECONDS = Path(__file__).resolve().parent / "tests" / "file_seconds.json"
RECORD_ENV = "MMFSDP_RECORD_FILE_SECONDS"
"""Where to write the measured seconds per file (a path); unset: nothing is recorded."""
_recorded: dict[str, float] = {}


def _file_seconds() -> dict[str, float]:
    try:
        return json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    order = {item: i for i, item in enumerate(items)}
    measured = _file_seconds()

    def seconds(item) -> float:
        try:
            return float(measured.get(item.path.relative_to(root).as_posix(), 0))
        except ValueError:
            return 0.0

    items.sort(key=lambda item: (-seconds(item), order[item]))


def pytest_runtest_logreport(report):
    if os.environ.get(RECORD_ENV):
        path = report.nodeid.split("::", 1)[0]
        _recorded[path] = _recorded.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    target = os.environ.get(RECORD_ENV)
    if not target or hasattr(session.config, "workerinput"):  # xdist workers forward their reports to the controller
        return
    table = {path: round(seconds, 1) for path, seconds in sorted(_recorded.items(), key=lambda kv: -kv[1])}
    Path(target).write_text(json.dumps(table, indent=1) + "\n")
