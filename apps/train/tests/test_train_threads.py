"""A rank applies OMP_NUM_THREADS to torch's intra-op pool even when torch was loaded before it was set (the CPU
launcher forks its ranks from a process that imported torch)."""

import torch

from mmfsdp.train.trainer import set_intra_op_threads


def test_rank_applies_omp_num_threads_after_torch_loaded(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_intra_op_threads() == 1 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_intra_op_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_unset_or_invalid_omp_num_threads_leaves_torch_alone(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert set_intra_op_threads() == 2
        for value in ("", "0", "four", "-1"):
            monkeypatch.setenv("OMP_NUM_THREADS", value)
            assert set_intra_op_threads() == 2, value
    finally:
        torch.set_num_threads(before)
