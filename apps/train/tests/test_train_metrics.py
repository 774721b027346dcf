"""metrics.jsonl holds each step once: a resumed run drops the rows after its resume step, a fresh run moves an
earlier run's file aside; the writer appends after that."""

import json
import os
import re

from mmfsdp.train.metrics import MetricsWriter, open_metrics_file


def _rows(steps, **extra):
    return "".join(json.dumps({"step": s, "loss": float(s), **extra}) + "\n" for s in steps)


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_train_metrics_resume_drops_rows_after_the_resume_step_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_rows(range(1, 13)) + '{"step": 13, "lo')  # killed at step 13 mid-write
    note = open_metrics_file(path, 10)
    assert note is not None and "dropped 3 rows" in note and "after step 10" in note
    assert _steps(path) == list(range(1, 11))
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"], "nothing left beside it"


def test_train_metrics_resume_keeps_a_file_without_later_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_rows(range(20, 101, 20)))
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert open_metrics_file(path, 100) is None
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert open_metrics_file(tmp_path / "absent.jsonl", 5) is None


def test_train_metrics_fresh_run_moves_the_earlier_file_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for run in range(2):
        path.write_text(_rows(range(1, 4), run=run))
        os.utime(path, (1_700_000_000, 1_700_000_000))  # both earlier runs ended in the same second
        note = open_metrics_file(path, 0)
        assert note is not None and "moved it to metrics." in note
        assert not path.exists()
    moved = sorted(p.name for p in tmp_path.iterdir())
    assert len(moved) == 2 and all(re.fullmatch(r"metrics\.\d{8}_\d{6}(-1)?\.jsonl", name) for name in moved), moved
    assert {json.loads((tmp_path / name).read_text().splitlines()[0])["run"] for name in moved} == {0, 1}


def test_train_metrics_writer_continues_the_resumed_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "metrics.jsonl").write_text(_rows(range(1, 8)))
    writer = MetricsWriter(tmp_path, total_steps=8, start_step=5)
    for step in (6, 7, 8):
        writer.log_step({"step": step, "loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "num_tokens": 10,
                         "tokens_per_s": 100.0, "step_time_s": 0.1, "peak_mem_gb": 0.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows[5:]] == [0.5, 0.5, 0.5], "the resumed run's values, not the killed run's"
