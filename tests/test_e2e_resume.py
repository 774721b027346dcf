"""Exact resume through the real app: a 2-process run SIGKILLed mid-run and restarted with the same
command continues with per-step losses bitwise identical to the uninterrupted run (fp32, CPU),
mid-epoch and with gradient accumulation. Also: an interrupted run leaves the tracker on a complete
checkpoint, and a changed world size resumes model and optimizer. (Meta-device init: test_e2e_resume_meta.py.)
The uninterrupted run is the trainer the app's ranks run, in-process (`apprun.train_in_process`); its step-3
checkpoint is also the one the 1-process run resumes.
"""

import json
import shutil

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.ckpt.layout import iteration_dirname, write_tracker
from tiny_resume import STEPS, TINY, command, items, prepared_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_data(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run (the app's trainer in-process: the app's losses bitwise), with its checkpoints."""
    out = apprun.train_in_process(TINY, items(data, tmp_path_factory.mktemp("reference") / "run"))
    losses = apprun.first_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return out, losses


def test_sigkill_and_restart_continue_bitwise(data, reference, tmp_path):
    _, reference = reference
    out = tmp_path / "killed"
    metrics = out / "metrics.jsonl"
    apprun.kill_when(apprun.start(command(data, out)), lambda: any(r["step"] >= 5 for r in apprun.records(out)),
                     "step 5")
    tracker = read_tracker(out / "ckpt")
    assert tracker in (3, 6), f"tracker points at {tracker!r}"
    # Mark the rows the killed run logged after its checkpoint: the restart must replace them, not keep them.
    rows = apprun.records(out)
    assert max(r["step"] for r in rows) > tracker
    marked = [{**r, "killed_run": True} if r["step"] > tracker else r for r in rows]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in marked))

    restart = apprun.run(command(data, out))
    assert f"at step {tracker}" in restart.stdout, [l for l in restart.stdout.splitlines() if "step" in l][:5]
    assert f"dropped {len(rows) - tracker} rows of metrics.jsonl after step {tracker}" in restart.stdout
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in after] == list(range(1, STEPS + 1)), "each step once"
    assert after[:tracker] == rows[:tracker], "the rows up to the checkpoint are kept as they were"
    assert not any("killed_run" in r for r in after[tracker:]), "the rows after the checkpoint are the restart's"
    for record in after:
        assert record["loss"] == reference[record["step"]], f"step {record['step']}: {record} vs {reference}"


def test_resume_on_a_different_world_size_loads_model_and_optimizer(data, reference, tmp_path):
    """The 2-process reference's step-3 checkpoint (and its metrics.jsonl) resumed by the app on 1 process."""
    reference_out, _ = reference
    out = tmp_path / "reshard"
    shutil.copytree(reference_out / "ckpt" / iteration_dirname(3), out / "ckpt" / iteration_dirname(3))
    write_tracker(out / "ckpt", 3)
    shutil.copy(reference_out / "metrics.jsonl", out / "metrics.jsonl")
    assert read_tracker(out / "ckpt") == 3
    proc = apprun.run(command(data, out, nproc=1))
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout, proc.stdout[-2000:]
    assert apprun.logged_steps(out) == list(range(1, STEPS + 1)), "steps 1-3 kept, 4-8 the resumed run's"
