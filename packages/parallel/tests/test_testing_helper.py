import pytest
import torch
import torch.distributed as dist

from mmfsdp.parallel.testing import run_distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on one")
    dist.barrier()


def test_values_come_back_in_rank_order():
    assert run_distributed(_all_reduce, 2) == [3.0, 3.0]


def test_failure_on_one_rank_is_reported_without_hanging():
    with pytest.raises(AssertionError, match="boom on one"):
        run_distributed(_fails_on_rank_one, 2, timeout=60)


def _returns_tensors(rank, world_size):
    return {"rank": rank, "t": torch.full((2,), float(rank))}


def test_tensors_come_back_after_the_ranks_exit():
    out = run_distributed(_returns_tensors, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.tensor([1.0, 1.0]))


def _dies_on_rank_one(rank, world_size):
    import os
    import time

    if rank == 1:
        os._exit(3)  # killed, in effect: no traceback, nothing reported
    time.sleep(100)  # rank 0 waits on nothing that would notice


def test_a_rank_that_dies_without_reporting_fails_the_run_at_once():
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed:\nexited with code 3 before reporting"):
        run_distributed(_dies_on_rank_one, 2, timeout=120)
    assert time.monotonic() - started < 30  # not the 120 s timeout, nor rank 0's 100 s



def _segfaults_on_rank_one(rank, world_size, stderr_path):
    import ctypes
    import os
    import time

    if rank == 1:
        # this rank's stderr (fd 2, where faulthandler writes) into a file the test reads: the rank inherits the
        # forkserver's fd 2, which is whatever the test that started the forkserver captured
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        ctypes.string_at(0)  # a segmentation fault, as an extension's would be
    time.sleep(100)


def test_a_rank_that_dies_on_a_signal_prints_where(tmp_path):
    stderr = tmp_path / "rank1.err"
    with pytest.raises(AssertionError, match="rank 1 failed:\nexited with code -11 before reporting"):
        run_distributed(_segfaults_on_rank_one, 2, str(stderr), timeout=120)
    err = stderr.read_text()
    assert "Fatal Python error: Segmentation fault" in err  # faulthandler's dump (`enable_fault_stacks`)
    assert "in _segfaults_on_rank_one" in err, err[-2000:]
