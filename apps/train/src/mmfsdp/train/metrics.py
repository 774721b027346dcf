"""One human line per logged step on rank 0, and the same numbers as JSONL.

`metrics.jsonl` is appended to (a resumed run continues the same file); `step`
counts optimizer steps from 1.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mmfsdp.config import current_rank, get_logger

log = get_logger("mmfsdp.train")


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class MetricsWriter:
    def __init__(self, output_dir: str | Path, total_steps: int, start_step: int = 0):
        """`start_step`: the step the run is at when the timer starts (the resumed step, 0 for a fresh run)."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.total_steps = total_steps
        self.start_step = start_step
        self._started = time.perf_counter()

    def eta_s(self, step: int) -> float:
        """Seconds left after `step`, from the steps actually done since the timer started."""
        done = step - self.start_step
        if done < 1:
            return 0.0
        return (time.perf_counter() - self._started) / done * (self.total_steps - step)

    def log_step(self, record: dict) -> None:
        """`record` holds step, loss, grad_norm, lr, num_tokens, tokens_per_s, step_time_s, peak_mem_gb (and for a
        MoE family aux_loss, expert_load_max, expert_load_mean; at a validation step val_loss)."""
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
            f" | peak {record['peak_mem_gb']:.2f} GB | ETA {format_duration(eta)}"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
