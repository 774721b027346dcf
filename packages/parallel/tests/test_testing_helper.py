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
