"""Profiling, a component of the training loop: a torch.profiler trace (`tools.profile`) and a memory snapshot
(`tools.memory_profile`, `mmfsdp.parallel.memory_snapshot`) of chosen steps on chosen ranks.

The loop enters `Profiling` once around all its steps and wraps each step in `step(n)`; the component decides
for itself whether this rank records and which steps: the trace's schedule waits until `profile.start_step`
(counted from the step the run starts at) and stops after `end_step`; the snapshot starts recording before
the first step of `memory_profile.start_step..end_step` (holding the model's and optimizer's state tensors from
the start) and is written after `end_step`. Nothing runs on a rank that records neither.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from mmfsdp.config import get_logger

__all__ = ["Profiling"]

log = get_logger("mmfsdp.train")


class Profiling:
    """The trace and memory snapshot of one rank (module docstring)."""

    def __init__(
        self, tools_cfg: Any, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device_type: str,
        rank: int, output_dir: Path, start_step: int,
    ):
        self.profile_cfg = tools_cfg.profile
        self.memory_cfg = tools_cfg.memory_profile
        self.model = model
        self.optimizer = optimizer
        self.device_type = device_type
        self.rank = rank
        self.output_dir = output_dir
        self.start_step = start_step
        self._profiler = None
        self._snapshot = None
        self._recording = False

    def __enter__(self) -> Profiling:
        self._profiler = self._start_profiler()
        self._snapshot = self._memory_snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the work of optimizer step `step` (counted from 1)."""
        mp = self.memory_cfg
        if self._snapshot is not None and not self._recording and mp.start_step <= step <= mp.end_step:
            from mmfsdp.parallel.tensor_memory import state_tensors

            self._snapshot.start(state_tensors(self.model, self.optimizer))
            self._recording = True
        yield
        if self._profiler is not None:
            self._profiler.step()
        if self._recording:
            self._snapshot.step_done(step)
            if step == mp.end_step:
                path = self._snapshot.dump(self._snapshot_path(self._snapshot.suffix))
                log.info(f"memory snapshot of steps {mp.start_step}-{mp.end_step} written to {path}")
                self._snapshot = None
                self._recording = False

    def _start_profiler(self):
        p = self.profile_cfg
        if not p.enable or (p.ranks is not None and self.rank not in p.ranks):
            return None
        out = p.output_dir or str(self.output_dir / "profile")
        activities = [torch.profiler.ProfilerActivity.CPU] if p.with_cpu or self.device_type != "cuda" else []
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=max(p.start_step - 1 - self.start_step, 0), warmup=0, active=p.end_step - p.start_step + 1,
                repeat=1,
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{self.rank}"),
            record_shapes=p.record_shapes, profile_memory=p.with_memory, with_stack=p.with_stack,
        )
        prof.start()
        return prof

    def _memory_snapshot(self):
        """A `MemorySnapshot` when this rank records one, else None."""
        mp = self.memory_cfg
        if not mp.enable or self.rank not in mp.dump_ranks or self.start_step >= mp.end_step:
            return None
        from mmfsdp.parallel.memory_snapshot import MemorySnapshot

        return MemorySnapshot(self.device_type, stacks=mp.stacks, max_entries=mp.max_entries)

    def _snapshot_path(self, suffix: str) -> Path:
        mp = self.memory_cfg
        out = Path(mp.save_path) if mp.save_path else self.output_dir / "memory_snapshot"
        return out / f"snapshot_rank{self.rank}_steps{mp.start_step}-{mp.end_step}{suffix}"
