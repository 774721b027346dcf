"""Memory snapshots of chosen training steps: every device allocation, with its stack, for the memory viewer.

`MemorySnapshot(device_type, stacks=, max_entries=)`: `start(held)` before the first recorded step,
`step_done(step)` after each, `dump(path)` after the last, which writes the file and stops recording.

- CUDA, NPU: the allocator's own history, `torch.<device>.memory._record_memory_history` and
  `_dump_snapshot` (a pickle for https://pytorch.org/memory_viz; `torch_npu` provides the same functions).
- CPU: no allocator keeps a history, so the snapshot says what can be measured: the tensor memory alive at
  once (`TensorMemory`, through the dispatcher; `held` counts the parameters, gradients and optimizer states
  that exist before the first step) — its peak per recorded step and overall, as JSON.

Only the ranks that record call these; recording needs no collective.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Literal

import torch

from mmfsdp.parallel.tensor_memory import TensorMemory

__all__ = ["MemorySnapshot"]


class MemorySnapshot:
    def __init__(self, device_type: str, *, stacks: Literal["python", "all"] = "all", max_entries: int | None = None):
        self.device_type = device_type
        self.stacks = stacks
        self.max_entries = max_entries
        self._tensors: TensorMemory | None = None
        self._steps: list[dict[str, int]] = []

    @property
    def suffix(self) -> str:
        """The snapshot file's extension: `.pickle` (the allocator's), `.json` on the CPU."""
        return ".json" if self.device_type == "cpu" else ".pickle"

    def start(self, held: Iterable[torch.Tensor] = ()) -> None:
        if self.device_type == "cpu":
            self._tensors = TensorMemory("cpu")
            self._tensors.__enter__()
            self._tensors.hold(held)
            return
        memory = getattr(torch, self.device_type).memory
        memory._record_memory_history(stacks=self.stacks, max_entries=self.max_entries or sys.maxsize)

    def step_done(self, step: int) -> None:
        if self._tensors is not None:
            self._steps.append({"step": step, "peak_bytes": self._tensors.peak, "current_bytes": self._tensors.current})
            self._tensors.peak = self._tensors.current  # the next step's peak starts from what is alive now

    def dump(self, path: str | Path) -> Path:
        """Write the snapshot to `path` (its parent is created) and stop recording."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._tensors is None:
            memory = getattr(torch, self.device_type).memory
            memory._dump_snapshot(str(path))
            memory._record_memory_history(enabled=None)
            return path
        self._tensors.__exit__(None, None, None)
        record = {
            "device": "cpu",
            "what": "tensor memory alive at once (mmfsdp.parallel.tensor_memory.TensorMemory): the CPU allocator keeps no history",
            "peak_bytes": max((s["peak_bytes"] for s in self._steps), default=self._tensors.peak),
            "steps": self._steps,
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        self._tensors = None
        return path
