"""Exact resume through the real app: a 2-process run SIGKILLed mid-run and restarted with the same
command continues with per-step losses bitwise identical to the uninterrupted run (fp32, CPU),
mid-epoch and with gradient accumulation. Also: an interrupted run leaves the tracker on a complete
checkpoint, and a changed world size resumes model and optimizer. (Meta-device init: test_e2e_resume_meta.py.)
"""

import json
import subprocess
import time

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from tiny_resume import ROOT, STEPS, command as _command, prepared_data

pytestmark = pytest.mark.slow

_losses = apprun.losses
_kill_tree = apprun.kill_tree
_run = apprun.run
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_data(tmp_path_factory)


def test_sigkill_and_restart_continue_bitwise(data, tmp_path):
    reference_out = tmp_path / "reference"
    _run(_command(data, reference_out))
    reference = _losses(reference_out)
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "killed"
    proc = subprocess.Popen(_command(data, out), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if metrics.exists() and any(json.loads(l)["step"] >= 5 for l in metrics.read_text().splitlines()):
            break
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.2)
    _kill_tree(proc.pid)
    proc.wait()
    tracker = read_tracker(out / "ckpt")
    assert tracker in (3, 6), f"tracker points at {tracker!r}"
    # Mark the rows the killed run logged after its checkpoint: the restart must replace them, not keep them.
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    assert max(r["step"] for r in rows) > tracker
    marked = [{**r, "killed_run": True} if r["step"] > tracker else r for r in rows]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in marked))

    restart = _run(_command(data, out))
    assert f"at step {tracker}" in restart.stdout, [l for l in restart.stdout.splitlines() if "step" in l][:5]
    assert f"dropped {len(rows) - tracker} rows of metrics.jsonl after step {tracker}" in restart.stdout
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in after] == list(range(1, STEPS + 1)), "each step once"
    assert after[:tracker] == rows[:tracker], "the rows up to the checkpoint are kept as they were"
    assert not any("killed_run" in r for r in after[tracker:]), "the rows after the checkpoint are the restart's"
    for record in after:
        assert record["loss"] == reference[record["step"]][0], f"step {record['step']}: {record} vs {reference}"


def test_resume_on_a_different_world_size_loads_model_and_optimizer(data, tmp_path):
    out = tmp_path / "reshard"
    cmd = _command(data, out)
    first = [c if c != f"training.train_iters={STEPS}" else "training.train_iters=3" for c in cmd]
    _run(first)
    assert read_tracker(out / "ckpt") == 3
    proc = _run(_command(data, out, nproc=1))
    assert "resumed from" in proc.stdout
    steps = _losses(out)
    assert sorted(steps) == list(range(1, STEPS + 1))
