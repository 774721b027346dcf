"""The heartbeat in-process: a watched thread that stops making progress is reported (phase, the collective it
waits in, the full stack in hang_rank<r>.txt); pauses and beats keep it quiet."""

import threading
import time

from mmfsdp.train.supervise import Heartbeat


def _watched_worker(stop: threading.Event, ready: threading.Event):
    """A thread that waits, inside a frame of torch.distributed, until `stop` is set."""

    def wait_in_collective():
        from torch.distributed import distributed_c10d

        def fake_all_reduce():
            ready.set()
            stop.wait(30)

        # A frame that reports torch/distributed/distributed_c10d.py as its file, as a blocked collective does.
        code = compile("def all_reduce(wait):\n    wait()\n", distributed_c10d.__file__, "exec")
        namespace: dict = {}
        exec(code, namespace)
        namespace["all_reduce"](fake_all_reduce)

    return threading.Thread(target=wait_in_collective, daemon=True)


def _heartbeat(tmp_path, thread, timeout_s=0.3):
    hangs = []
    hb = Heartbeat(timeout_s, rank=3, output_dir=tmp_path, thread=thread, on_hang=lambda: hangs.append(time.monotonic()))
    return hb, hangs


def test_train_heartbeat_reports_the_collective_and_phase(tmp_path, capsys):
    stop, ready = threading.Event(), threading.Event()
    worker = _watched_worker(stop, ready)
    worker.start()
    assert ready.wait(10)
    hb, hangs = _heartbeat(tmp_path, worker)
    hb.start()
    started = time.monotonic()
    hb.beat("step 7 micro-batch 2/4", arm=True)
    deadline = time.monotonic() + 10
    while not hangs and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    worker.join()
    hb.stop()
    assert len(hangs) == 1 and 0.3 <= hangs[0] - started < 2.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("[rank 3] no progress for ") and "parallel.heartbeat_timeout_s=0.3" in line
    assert "in step 7 micro-batch 2/4; waiting in all_reduce (distributed_c10d.py:2)" in line
    report = (tmp_path / "hang_rank3.txt").read_text()
    assert report.startswith(line + "\n\n")
    assert "wait_in_collective" in report and "fake_all_reduce" in report  # the full stack, innermost last


def test_train_heartbeat_is_quiet_while_paused_and_while_beating(tmp_path, capsys):
    stop, ready = threading.Event(), threading.Event()
    worker = _watched_worker(stop, ready)
    worker.start()
    assert ready.wait(10)
    hb, hangs = _heartbeat(tmp_path, worker, timeout_s=0.2)
    hb.start()
    hb.beat("step 1 micro-batch 1/1")  # the first step: not armed
    time.sleep(0.5)
    hb.beat("step 2", arm=True)
    for _ in range(10):  # beats more often than the timeout
        time.sleep(0.05)
        hb.beat("step 2 micro-batch 1/1")
    hb.pause("saving the checkpoint of step 2")
    time.sleep(0.5)
    assert hangs == []
    hb.beat("step 3", arm=True)
    time.sleep(0.6)
    stop.set()
    worker.join()
    hb.stop()
    assert len(hangs) == 1
    assert "in step 3;" in capsys.readouterr().err


def test_train_heartbeat_module_functions_are_noops_without_a_heartbeat(tmp_path):
    from mmfsdp.train import supervise

    assert supervise.start_heartbeat(0, rank=0, output_dir=tmp_path) is None
    supervise.beat("step 1", arm=True)
    supervise.pause("save")
    hb = supervise.start_heartbeat(60, rank=0, output_dir=tmp_path)
    try:
        supervise.beat("step 5", arm=True)
        assert (hb.phase, hb.armed) == ("step 5", True)
        supervise.pause("the final evaluation")
        assert (hb.phase, hb.armed) == ("the final evaluation", False)
    finally:
        supervise.start_heartbeat(0, rank=0, output_dir=tmp_path)
    assert not list(tmp_path.iterdir())
