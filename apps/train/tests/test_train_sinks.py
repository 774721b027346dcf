"""The metrics writer feeds its sinks every number of each record; a TensorBoard sink opened for a resumed run
hides what the interrupted run logged after the resume step (read back with tensorboard's EventAccumulator)."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmfsdp.train.config import Config
from mmfsdp.train.metrics import MetricsWriter
from mmfsdp.train.sinks import TensorBoardSink, build_sinks


class _Recorder:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, step, scalars):
        self.rows.append((step, scalars))

    def close(self):
        self.closed = True


def _record(step, loss):
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "num_tokens": 10, "tokens_per_s": 100.0,
            "step_time_s": 0.1, "peak_mem_gb": 0.0, "tflops": 0.5, "mfu": 0.25}


def test_train_sinks_get_every_scalar_of_the_record(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    sink = _Recorder()
    writer = MetricsWriter(tmp_path, total_steps=2, sinks=[sink])
    writer.log_step({**_record(1, 0.5), "val_loss": 0.7})
    writer.close()
    (step, scalars), = sink.rows
    assert step == 1 and scalars == {k: v for k, v in {**_record(1, 0.5), "val_loss": 0.7}.items() if k != "step"}
    assert sink.closed and writer.sinks == []


def _losses(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def test_train_sinks_tensorboard_resume_hides_the_steps_after_the_checkpoint(tmp_path):
    log_dir = tmp_path / "tb"
    first = TensorBoardSink(log_dir, start_step=0, config_yaml="a: 1")
    for step in (1, 2, 3, 4):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = TensorBoardSink(log_dir, start_step=2, config_yaml="a: 1")  # the checkpoint of step 2
    for step in (3, 4, 5):
        resumed.write(step, {"loss": 10.0 + step})
    resumed.close()
    assert _losses(log_dir) == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    fresh = TensorBoardSink(log_dir, start_step=0, config_yaml="a: 1")  # a new run into the same directory
    fresh.write(1, {"loss": 0.5})
    fresh.close()
    assert _losses(log_dir) == [(1, 0.5)]


def test_train_sinks_off_by_default(tmp_path):
    assert build_sinks(Config().tools.report_to, output_dir=tmp_path, start_step=0, config=Config()) == []
    assert not any(tmp_path.iterdir())
