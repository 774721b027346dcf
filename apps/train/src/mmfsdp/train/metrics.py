"""One human line per logged step on rank 0, the same numbers as JSONL, and to the metrics sinks.

Each record also goes to the sinks of `tools.report_to` (TensorBoard, W&B: `mmfsdp.train.sinks`), which
continue a resumed run's series the same way.

`<output_dir>/metrics.jsonl` holds each step once; `step` counts optimizer steps from 1.
When the writer opens (rank 0, after the trainer knows where the run starts):

- a resumed run at step N keeps the rows of steps 1..N and drops the later ones, which the
  interrupted run logged after its last checkpoint: the resumed run logs those steps again. The
  file is rewritten beside itself, fsynced and renamed over the old one, so a crash in between
  leaves the old file or the new one, never a mix. Then it appends.
- a fresh run (step 0) into an output_dir that already holds a `metrics.jsonl` moves that file
  to `metrics.<YYYYmmdd_HHMMSS>.jsonl` (its last write time) and says so in one line: the new
  run starts its own file instead of appending a second step-1 sequence.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from mmfsdp.ckpt.layout import write_file_atomic
from mmfsdp.config import current_rank, get_logger
from mmfsdp.train.sinks import MetricsSink

log = get_logger("mmfsdp.train")


def open_metrics_file(path: Path, start_step: int) -> str | None:
    """Make `path` ready for a run that starts after `start_step` (see the module docstring); returns the line
    saying what was done to an existing file, or None when nothing was."""
    if not path.is_file():
        return None
    if start_step == 0:
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(path.stat().st_mtime))
        moved = path.with_name(f"metrics.{stamp}.jsonl")
        suffix = 1
        while moved.exists():
            moved = path.with_name(f"metrics.{stamp}-{suffix}.jsonl")
            suffix += 1
        os.replace(path, moved)
        return f"metrics: {path} held an earlier run's steps; moved it to {moved.name} (this run starts a new file)"
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if _row_step(line) is not None and _row_step(line) <= start_step]
    if len(kept) == len(lines):
        return None
    if kept and not kept[-1].endswith(b"\n"):
        kept[-1] += b"\n"
    write_file_atomic(path, b"".join(kept))
    return (f"metrics: dropped {len(lines) - len(kept)} rows of {path.name} after step {start_step} "
            f"(logged after the checkpoint this run resumes from; they are logged again)")


def _row_step(line: bytes) -> int | None:
    """The step of one JSONL row; None for a row that is not a whole record (a line cut short by a kill)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class MetricsWriter:
    def __init__(
        self, output_dir: str | Path, total_steps: int, start_step: int = 0, sinks: Sequence[MetricsSink] = ()
    ):
        """`start_step`: the step the run is at when the timer starts (the resumed step, 0 for a fresh run);
        `sinks`: where each record's scalars also go (`mmfsdp.train.sinks`, rank 0's)."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.total_steps = total_steps
        self.start_step = start_step
        self.sinks = list(sinks)
        self._started = time.perf_counter()
        if current_rank() == 0:
            note = open_metrics_file(self.path, start_step)
            if note:
                log.info(note)

    def eta_s(self, step: int) -> float:
        """Seconds left after `step`, from the steps actually done since the timer started."""
        done = step - self.start_step
        if done < 1:
            return 0.0
        return (time.perf_counter() - self._started) / done * (self.total_steps - step)

    def log_step(self, record: dict) -> None:
        """`record` holds step, loss, grad_norm, lr, num_tokens, tokens_per_s, step_time_s, peak_mem_gb, tflops, mfu
        (hfu with recompute; for a MoE family aux_loss, expert_load_max, expert_load_mean; at a validation step
        val_loss), rank_imbalance and padding_fraction (planned_imbalance with a step plan;
        `mmfsdp.train.balance_meter`)."""
        if current_rank() != 0:
            return
        step = record["step"]
        eta = self.eta_s(step)
        width = len(str(self.total_steps))
        log.info(
            f"step {step:>{width}}/{self.total_steps} | loss {record['loss']:.4f}"
            + (f" | aux {record['aux_loss']:.4f} | expert load max/mean {record['expert_load_max']:.0f}/"
               f"{record['expert_load_mean']:.1f}" if "aux_loss" in record else "")
            + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
            + f" | grad_norm {record['grad_norm']:.3f}"
            f" | lr {record['lr']:.3e} | {record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1000:.0f} ms/step"
            + (f" | {record['tflops']:.3g} TFLOP/s | MFU {record['mfu']:.1%}" if "mfu" in record else "")
            + (f" | HFU {record['hfu']:.1%}" if "hfu" in record else "")
            + (f" | rank imbalance {record['rank_imbalance']:.2f}" if "rank_imbalance" in record else "")
            + (f" (plan {record['planned_imbalance']:.2f})" if "planned_imbalance" in record else "")
            + (f" | padding {record['padding_fraction']:.1%}" if "padding_fraction" in record else "")
            + f" | peak {record['peak_mem_gb']:.2f} GB | ETA {format_duration(eta)}"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        scalars = {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))}
        for sink in self.sinks:
            sink.write(step, scalars)

    def close(self) -> None:
        """Flush and close the sinks (the end of the run)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []
