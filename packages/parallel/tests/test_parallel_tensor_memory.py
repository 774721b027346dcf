"""`TensorMemory`: live tensor bytes through the dispatcher, including storages resized in place (FSDP2's reshard)."""

import torch

from mmfsdp.parallel.tensor_memory import TensorMemory

MiB = 2**20


def test_counts_allocations_and_frees_and_keeps_the_peak():
    with TensorMemory("cpu") as mem:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        view = b[:10]
        del b
        assert mem.current == 3 * MiB  # the view keeps b's storage
        del view, a
    assert (mem.current, mem.peak) == (0, 3 * MiB)


def test_held_tensors_count_once():
    x = torch.empty(MiB, dtype=torch.uint8)
    views = [x, x[:5], x.view(2, -1)]
    with TensorMemory("cpu") as mem:
        assert mem.hold(views) == MiB
        assert mem.current == MiB


def test_a_storage_resized_to_zero_and_back_counts_only_while_allocated():
    # FSDP2 frees a gathered parameter with storage.resize_(0) and gathers into the same storage later
    param = torch.empty(4 * MiB, dtype=torch.uint8)
    param.untyped_storage().resize_(0)  # resharded before the measured step
    with TensorMemory("cpu") as mem:
        for _ in range(3):  # forward gather, backward gather, next step's gather
            param.untyped_storage().resize_(4 * MiB)
            torch.ones(1).add_(1)  # other work in between: the address may be reused
            assert mem.current == 4 * MiB
            param.untyped_storage().resize_(0)
            assert mem.current == 0
        tracked = torch.empty(MiB, dtype=torch.uint8)
        tracked.untyped_storage().resize_(0)
        assert mem.current == 0
        del tracked
    assert mem.current == 0 and 4 * MiB <= mem.peak < 4 * MiB + 64  # + the 4-byte temporary
    assert torch.UntypedStorage.resize_ is mem._resize  # the hook is gone after the context


def test_a_new_storage_at_a_freed_address_is_counted():
    with TensorMemory("cpu") as mem:
        for _ in range(20):
            t = torch.empty(MiB, dtype=torch.uint8)
            assert mem.current == MiB
            del t
            assert mem.current == 0
    assert mem.peak == MiB
