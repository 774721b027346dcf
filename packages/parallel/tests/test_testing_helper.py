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
