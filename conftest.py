"""Suite-wide test ordering (scheduling only; no fixtures here).

The suite runs on two xdist workers that take whole files (`-n 2 --dist loadfile`, pyproject.toml).
Files with tests marked `slow` (the end-to-end runs of the app) are collected first, so the long files
start at once and the many short ones fill the gaps at the end; the order inside each group is kept.
Two workers already fill the cores, so each test process (and every rank it spawns, which inherits the
environment) computes on one thread unless OMP_NUM_THREADS says otherwise; the app's launcher does the same.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: False (slow) first
