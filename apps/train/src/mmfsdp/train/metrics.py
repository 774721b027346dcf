"""The loop's metrics component (`Metrics`) and its writer: one human line per logged step on rank 0, the same
numbers as JSONL, and to the metrics sinks.

`Metrics` decides which steps log (every `training.log_interval` steps, the last step and every validation
step), keeps every step's `StepResult` (`history`) and reads their device values only on logging steps and
before a checkpoint (`check`, `mmfsdp.train.step`): a step that does not log makes the host wait for nothing.
A logging step is timed on its own (the device is synchronised before and after it), so `step_time_s`,
`tokens_per_s` and MFU are that step's. `check` raises `NonFiniteLoss` for the first step whose loss or
gradient norm is NaN/inf, with the last finite loss, and trims `history` to the steps before it.

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

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from mmfsdp.ckpt.layout import write_file_atomic
from mmfsdp.config import current_rank, get_logger
from mmfsdp.parallel import peak_memory_gb, reset_peak_memory, synchronize
from mmfsdp.train.sinks import MetricsSink
from mmfsdp.train.step import NonFiniteLoss, StepResult, first_non_finite, settle

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


_RECORD_KEYS = frozenset({
    "step", "loss", "grad_norm", "lr", "num_tokens", "tokens_per_s", "step_time_s", "peak_mem_gb", "tflops", "mfu",
    "hfu", "val_loss", "rank_imbalance", "planned_imbalance", "padding_fraction",
})
"""The keys every record may hold; any other key is a family's step statistic."""


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
        (hfu with recompute; the family's step statistics, e.g. a MoE family's aux_loss, expert_load_max,
        expert_load_mean; at a validation step val_loss), rank_imbalance and padding_fraction (planned_imbalance
        with a step plan; `mmfsdp.train.balance_meter`)."""
        if current_rank() != 0:
            return
        step = record["step"]
        eta = self.eta_s(step)
        width = len(str(self.total_steps))
        family_stats = "".join(f" | {key} {value:.4g}" for key, value in record.items() if key not in _RECORD_KEYS)
        log.info(
            f"step {step:>{width}}/{self.total_steps} | loss {record['loss']:.4f}"
            + family_stats
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


class Metrics:
    """The training loop's metrics component (module docstring): which steps log, their timing, the record."""

    def __init__(
        self, *, log_interval: int, total_steps: int, writer: MetricsWriter, flop_meter: Any, device: Any,
        validates: Callable[[int], bool] = lambda step: False, meters: Sequence[Any] = (),
    ):
        """`validates(step)`: whether the evaluator computes a validation loss at `step` (such a step logs);
        `meters`: components whose `scalars()` (a collective on every rank) join each logged record."""
        self.log_interval = log_interval
        self.total_steps = total_steps
        self.writer = writer
        self.flop_meter = flop_meter
        self.device = device
        self.validates = validates
        self.meters = list(meters)
        self.history: list[StepResult] = []
        """Every step of this run, in order (settled up to the last logging step)."""
        self._checked = 0
        """How many results of `history` are settled and finite."""
        self._step_time_s: float | None = None

    def logs(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.total_steps or self.validates(step)

    @contextlib.contextmanager
    def timed(self, step: int) -> Iterator[None]:
        """Around the work of `step`: on a logging step, synchronise the device before and after it and restart the
        peak-memory window, so the record's time and peak are this step's; else nothing."""
        if not self.logs(step):
            yield
            return
        synchronize(self.device)
        reset_peak_memory(self.device)
        started = time.perf_counter()
        yield
        synchronize(self.device)
        self._step_time_s = time.perf_counter() - started

    def step_done(self, result: StepResult, *, val_loss: float | None = None,
                  val_stats: dict[str, float] | None = None) -> None:
        """Keep `result`; on a logging step check every pending step (`check`) and write the record (with the
        stage's validation metrics `val_stats` at a validation step)."""
        self.history.append(result)
        if not self.logs(result.step):
            return
        self.check()
        step_time = self._step_time_s
        self.writer.log_step({
            "step": result.step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
            "num_tokens": result.num_tokens, "tokens_per_s": result.num_tokens / step_time,
            "step_time_s": step_time, "peak_mem_gb": peak_memory_gb(self.device),
            **self.flop_meter.scalars(result.flops, step_time),
            **result.stats, **{key: value for meter in self.meters for key, value in meter.scalars().items()},
            **({"val_loss": val_loss} if val_loss is not None else {}), **(val_stats or {}),
        })

    def check(self) -> None:
        """Settle the pending steps; raise `NonFiniteLoss` at the first non-finite one (and drop it and the steps
        after it from `history`). Called on logging steps and before every checkpoint."""
        pending = self.history[self._checked:]
        settle(pending)
        bad = first_non_finite(pending)
        if bad is None:
            self._checked = len(self.history)
            return
        failed = pending[bad]
        del self.history[self._checked + bad:]
        last = self.history[-1] if self.history else None
        last_text = f"last finite loss {last.loss:.6f} at step {last.step}" if last else "no finite loss yet"
        raise NonFiniteLoss(
            f"loss {failed.loss} / grad norm {failed.grad_norm} is not finite at step {failed.step} ({last_text}); "
            "lower training.lr, check the data, or resume from the last checkpoint",
            last_finite_step=failed.step - 1,
        )

    def close(self) -> None:
        self.writer.close()
