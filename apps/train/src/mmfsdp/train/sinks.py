"""Metrics sinks: TensorBoard and Weights & Biases, fed by the metrics writer on rank 0 (`tools.report_to`).

The `MetricsWriter` (`mmfsdp.train.metrics`) calls each sink with the record it writes to `metrics.jsonl`: every
number of the record but `step` is a scalar under the record's own key (`loss`, `lr`, `grad_norm`,
`tokens_per_s`, `tflops`, `mfu`, `peak_mem_gb`, `aux_loss`, `expert_load_max`, `val_loss`, …) at that step. The
resolved config goes with the run once: TensorBoard text `config` (the YAML), W&B's run config.

Resumed runs continue the same series without duplicates, as `metrics.jsonl` does:

- TensorBoard: the writer opens with `purge_step = start_step + 1`, a session-start event that makes readers
  (TensorBoard, `EventAccumulator`) drop the earlier files' events of step `start_step + 1` and later — what the
  interrupted run logged after the checkpoint the run resumes from (a fresh run drops an earlier run's steps
  from 1 on);
- W&B: the run id is kept in `<wandb_dir>/run_id`; a resumed run continues that run (`resume="allow"`), a fresh
  run starts a new one and writes its id. W&B runs offline (files only, `wandb sync` uploads them) unless
  `WANDB_API_KEY` is set or `WANDB_MODE` is; offline it never waits for the network. An offline resumed run is
  written to a new directory under the same id; steps the interrupted run logged after its checkpoint stay in
  the earlier directory.

Sinks exist on rank 0 only; a sink flushes each record so a killed run keeps what it logged.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from mmfsdp.ckpt.layout import write_file_atomic
from mmfsdp.config import dump_yaml, get_logger

log = get_logger("mmfsdp.train")


class MetricsSink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path, *, start_step: int, config_yaml: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)
        self.writer.add_text("config", "```yaml\n" + config_yaml + "\n```", global_step=start_step)
        self.writer.flush()

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, *, start_step: int, project: str, name: str, config: dict[str, Any]):
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_DISABLE_GIT", "true")
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # no crash reports sent anywhere
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "run_id"
        resume = start_step > 0 and id_file.is_file()
        run_id = id_file.read_text().strip() if resume else uuid.uuid4().hex[:8]
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, silent=True)
        self.run = wandb.init(
            project=project, name=name, id=run_id, dir=str(run_dir), config=config, resume="allow" if resume else None,
            settings=settings, reinit="create_new",
        )
        if not resume:
            write_file_atomic(id_file, f"{run_id}\n".encode())
        mode = os.environ.get("WANDB_MODE", "online")
        log.info(f"metrics: W&B run {run_id} ({'resumed' if resume else 'new'}, {mode}) under {run_dir}")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(
    report_to: list[str], *, output_dir: Path, start_step: int, config: Any, tensorboard_dir: str | None = None,
    wandb_dir: str | None = None, wandb_project: str = "mmfsdp", run_name: str | None = None,
) -> list[MetricsSink]:
    """The sinks `report_to` names (rank 0 calls this), opened for a run that starts after `start_step`, with the
    resolved `config` recorded."""
    from mmfsdp.config import to_dict

    sinks: list[MetricsSink] = []
    if "tensorboard" in report_to:
        path = Path(tensorboard_dir) if tensorboard_dir else output_dir / "tensorboard"
        sinks.append(TensorBoardSink(path, start_step=start_step, config_yaml=dump_yaml(config)))
        log.info(f"metrics: TensorBoard events in {path} (tensorboard --logdir {path})")
    if "wandb" in report_to:
        path = Path(wandb_dir) if wandb_dir else output_dir / "wandb"
        sinks.append(WandbSink(path, start_step=start_step, project=wandb_project,
                               name=run_name or output_dir.resolve().name, config=to_dict(config)))
    return sinks
