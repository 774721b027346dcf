"""Metrics sinks through the real app: a 2-process run of the tiny example with `tools.report_to: all` writes
TensorBoard events whose scalars equal metrics.jsonl's (read back with tensorboard's EventAccumulator) and an
offline W&B run with no network; MFU and TFLOP/s are in the log line and the records. A run resumed from an
earlier checkpoint than the last logged step shows each step once in TensorBoard and continues the same W&B run.
"""

import shutil

import numpy as np
import pytest

import apprun
from mmfsdp.ckpt.layout import iteration_dirname, read_tracker, write_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = apprun.TINY


def _items(data, out):
    return {
        **apprun.synthetic_items(data),
        **apprun.run_items(out, steps=3),
        "training.save_interval": 2,
        "training.save": out / "ckpt",
        "tools.report_to": "all",
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sinks")
    prepare_dataset(load_config(TINY, apprun.overrides(_items(tmp, tmp / "unused"))).data)
    return tmp


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, texts


def _f32(value):
    return float(np.float32(value))


def _wandb_runs(out):
    return sorted((out / "wandb" / "wandb").glob("offline-run-*"))


def test_tensorboard_and_wandb_offline_then_resume(data, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    cmd = apprun.command(TINY, _items(data, out))
    first = apprun.run(cmd, timeout=300)

    step_lines = [line for line in first.stdout.splitlines() if "| loss " in line]
    assert len(step_lines) == 3 and all("TFLOP/s | MFU " in line for line in step_lines), step_lines
    assert "mfu: peak " in first.stdout
    records = apprun.records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["mfu"] and 0 < r["tflops"] for r in records)

    scalars, texts = _scalars(out / "tensorboard")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "peak_mem_gb", "step_time_s"):
        assert scalars[key] == [(r["step"], _f32(r[key])) for r in records], key
    (config_text,) = texts["config/text_summary"]  # the resolved config
    assert "train_iters: 3" in config_text and "- tensorboard" in config_text

    (run_dir,) = _wandb_runs(out)
    run_id = (out / "wandb" / "run_id").read_text().strip()
    assert run_dir.name.endswith(f"-{run_id}")
    events = (run_dir / f"run-{run_id}.wandb").read_bytes()
    assert b"loss" in events and b"mfu" in events and b"tokens_per_s" in events

    # The run was killed after logging step 3 but before its checkpoint: the tracker names step 2.
    assert read_tracker(out / "ckpt") == 3
    shutil.rmtree(out / "ckpt" / iteration_dirname(3))
    write_tracker(out / "ckpt", 2)
    second = apprun.run(cmd, timeout=300)
    assert "at step 2" in second.stdout and "(resumed, offline)" in second.stdout
    records = apprun.records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    scalars, _ = _scalars(out / "tensorboard")
    assert scalars["loss"] == [(r["step"], _f32(r["loss"])) for r in records], "each step once, the resumed run's"
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    runs = _wandb_runs(out)
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), "the same W&B run continues"
