"""`MemorySnapshot` on the CPU (the tensor-memory peak per recorded step, as JSON) and `use_deterministic`."""

import json
import os

import torch

from mmfsdp.parallel import use_deterministic
from mmfsdp.parallel.memory_snapshot import MemorySnapshot


def test_cpu_snapshot_records_each_step_peak(tmp_path):
    held = torch.zeros(1024)  # 4 KiB that exist before recording starts
    snapshot = MemorySnapshot("cpu")
    assert snapshot.suffix == ".json"
    snapshot.start([held])
    for step, size in ((1, 256 * 1024), (2, 16 * 1024)):
        temporary = torch.ones(size)  # 1 MiB, then 64 KiB, freed before the next step
        del temporary
        snapshot.step_done(step)
    path = snapshot.dump(tmp_path / "snap" / "snapshot_rank0_steps1-2.json")
    record = json.loads(path.read_text())
    assert record["device"] == "cpu" and [s["step"] for s in record["steps"]] == [1, 2]
    peaks = [s["peak_bytes"] for s in record["steps"]]
    assert peaks == [4096 + 1024 * 1024, 4096 + 64 * 1024] and record["peak_bytes"] == peaks[0]


def test_use_deterministic_sets_the_flags_and_the_device_environment(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic("cuda")
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
