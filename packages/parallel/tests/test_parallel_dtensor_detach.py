"""`dtensor_detach_without_propagation`: FSDP2's parameter wrapping without DTensor sharding propagation, same result.

On 2 gloo ranks, a model of linear layers of distinct shapes (one frozen) is sharded twice from the same weights,
by `fully_shard` as torch does it and inside the context: every parameter has the same type, placements, global
shape and stride, local values, `requires_grad` and leaf-ness, and a forward and backward give bitwise equal loss
and local gradients. Sharding propagations are counted (DTensor's propagator wrapped): without the context the
wrapping propagates once per new shape, inside it not once, and `apply_fsdp` (the plan the trainer applies)
propagates nothing either. The handler table is as before after the context, also when it is left by an exception.
"""

import pytest
import torch
from torch import nn

from mmfsdp.parallel.testing import run_distributed

DIMS = [5, 7, 9, 11, 13]
SHAPES = list(zip(DIMS, DIMS[1:]))  # (in, out) of each block: four new weight and bias shapes


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in SHAPES), nn.Linear(SHAPES[-1][1], 1))
    model[1][0].weight.requires_grad_(False)
    return model


def _counting():
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    original = propagator.propagate_op_sharding_non_cached
    calls = []

    def counted(schema):
        calls.append(str(schema.op))
        return original(schema)

    propagator.propagate_op_sharding_non_cached = counted
    return calls


def _shard(model: nn.Module, fast: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from mmfsdp.parallel.dtensor_detach import dtensor_detach_without_propagation

    def apply():
        for block in model[:-1]:
            fully_shard(block)
        fully_shard(model)

    if fast:
        with dtensor_detach_without_propagation():
            apply()
    else:
        apply()
    return model


def _step(model: nn.Module, rank: int):
    torch.manual_seed(100 + rank)
    loss = model(torch.randn(3, SHAPES[0][0])).square().mean()
    loss.backward()
    grads = [p.grad.to_local().clone() if p.grad is not None else None for p in model.parameters()]
    return loss.detach(), grads


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    from mmfsdp.parallel.dtensor_detach import dtensor_detach_without_propagation
    from torch.distributed.device_mesh import init_device_mesh

    from mmfsdp.parallel.config import FSDPPlanConfig
    from mmfsdp.parallel.fsdp import apply_fsdp

    calls = _counting()
    plain = _shard(_model(), fast=False)
    plain_calls = [op for op in calls if "detach" in op]
    calls.clear()
    fast = _shard(_model(), fast=True)
    fast_calls = list(calls)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    left_clean = torch.ops.aten.detach.default not in handlers
    try:
        with dtensor_detach_without_propagation():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    left_clean = left_clean and torch.ops.aten.detach.default not in handlers

    same = []
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters(), strict=True):
        same.append((name, type(a) is type(b) is DTensor and isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter),
                     a.placements == b.placements, a.shape == b.shape, a.stride() == b.stride(),
                     torch.equal(a.to_local(), b.to_local()), a.requires_grad == b.requires_grad,
                     a.is_leaf and b.is_leaf))
    plain_loss, plain_grads = _step(plain, rank)
    fast_loss, fast_grads = _step(fast, rank)
    grads_equal = all((x is None and y is None) or torch.equal(x, y) for x, y in zip(plain_grads, fast_grads))

    calls.clear()
    mesh = init_device_mesh("cpu", (world_size,))
    apply_fsdp(_model(), FSDPPlanConfig(min_group_params=0), mesh, ["0", "1", "2", "3"])
    planned_calls = list(calls)
    return {"plain_calls": len(plain_calls), "fast_calls": fast_calls, "planned_calls": planned_calls,
            "same": same, "loss_equal": torch.equal(plain_loss, fast_loss), "grads_equal": grads_equal,
            "left_clean": left_clean}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2)


def test_the_wrapped_parameters_and_their_step_are_torchs(results):
    for rank in results:
        assert rank["same"] and all(all(flags[1:]) for flags in rank["same"]), rank["same"]
        assert rank["loss_equal"] and rank["grads_equal"]


def test_no_sharding_propagation_while_wrapping(results):
    for rank in results:
        assert rank["plain_calls"] >= len(SHAPES), rank  # torch's path propagates each new shape: the count is real
        assert rank["fast_calls"] == [], rank["fast_calls"]
        assert not any("detach" in op for op in rank["planned_calls"]), rank["planned_calls"]


def test_the_handler_table_is_restored(results):
    assert all(rank["left_clean"] for rank in results)
