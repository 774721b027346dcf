"""The direct point-to-point all-gather and reduce-scatter (`mmfsdp.parallel.direct_comm`) against gloo's own
collectives, alone and as FSDP2's collectives in training."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmfsdp.parallel import FSDPPlanConfig, MeshPlan, apply_fsdp, build_parallel_dims
from mmfsdp.parallel.direct_comm import DirectAllGather, DirectReduceScatter, install_direct_comm, supports_direct_comm
from mmfsdp.parallel.testing import run_distributed

CHUNK = 1001  # odd: no alignment to lean on


def _to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _inputs(world_size: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input (each rank computes all of them, to check sums locally)."""
    return [torch.randn(world_size * CHUNK, generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)]


def _collectives(rank, world_size):
    group = dist.group.WORLD
    inputs = _inputs(world_size)
    out = {"supported": supports_direct_comm(group)}
    # all-gather: FSDP2 hands the input as this rank's slice of the output; also a separate input
    ours = torch.full((world_size * CHUNK,), float("nan"))
    ours[rank * CHUNK:(rank + 1) * CHUNK] = inputs[rank][:CHUNK]
    assert DirectAllGather()(ours, ours[rank * CHUNK:(rank + 1) * CHUNK], group) is None
    theirs = torch.empty(world_size * CHUNK)
    dist.all_gather_into_tensor(theirs, inputs[rank][:CHUNK].clone())
    separate = torch.empty(world_size * CHUNK)
    DirectAllGather()(separate, inputs[rank][:CHUNK].clone(), group)
    out["all_gather_equal"] = torch.equal(ours, theirs) and torch.equal(separate, theirs)
    # reduce-scatter: SUM and AVG by the direct exchange, MAX through torch's own
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
        ours, theirs = torch.empty(CHUNK), torch.empty(CHUNK)
        DirectReduceScatter()(ours, inputs[rank].clone(), group, op)
        if op == dist.ReduceOp.AVG:  # gloo has no AVG: its SUM, divided
            dist.reduce_scatter_tensor(theirs, inputs[rank].clone(), op=dist.ReduceOp.SUM)
            theirs /= world_size
        else:
            dist.reduce_scatter_tensor(theirs, inputs[rank].clone(), op=op)
        out[name] = (ours, theirs)
    return _to_bytes(out)


def _check_collectives(world_size: int):
    inputs = _inputs(world_size)
    for rank, data in enumerate(run_distributed(_collectives, world_size)):
        out = torch.load(io.BytesIO(data))
        assert out["supported"]
        assert out["all_gather_equal"]
        chunks = [x[rank * CHUNK:(rank + 1) * CHUNK] for x in inputs]
        in_rank_order = chunks[0].clone()
        for chunk in chunks[1:]:
            in_rank_order += chunk
        ours, theirs = out["sum"]
        assert torch.equal(ours, in_rank_order), "the sum is taken in rank order"
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        if world_size == 2:  # one addition: the same bits as gloo's
            assert torch.equal(ours, theirs)
        ours, theirs = out["avg"]
        assert torch.equal(ours, in_rank_order / world_size)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        ours, theirs = out["max"]
        assert torch.equal(ours, theirs)
        assert torch.equal(ours, torch.stack(chunks).amax(0))


def test_parallel_direct_comm_equals_gloo_on_two_ranks():
    _check_collectives(2)


def test_parallel_direct_comm_sums_in_rank_order_on_four_ranks():
    _check_collectives(4)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 16))
                                    for _ in range(3))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def _train_both(rank, world_size, replicate):
    """Three AdamW steps of the same sharded model with the direct exchanges and with gloo's collectives."""
    dims = build_parallel_dims(MeshPlan(dp_replicate=replicate, dp_shard=world_size // replicate, ring=1, ulysses=1), "cpu")
    x = torch.randn(4 * world_size, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randn(4 * world_size, 3, generator=torch.Generator().manual_seed(4))
    rows = slice(4 * rank, 4 * rank + 4)
    results = {}
    for direct in (True, False):
        torch.manual_seed(0)
        model = _Net()
        apply_fsdp(model, FSDPPlanConfig(min_group_params=0, direct_cpu_comm=direct, reshard_after_forward=True),
                   dims.fsdp_mesh, ["layers.{*}"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], {}
        for step in range(3):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            if step == 0:
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            optimizer.step()
            losses.append(loss.detach())
        params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        installed = [install_direct_comm(m, dims.fsdp_mesh.get_group(dims.fsdp_mesh.ndim - 1)) for m in (model,)]
        results[direct] = {"losses": losses, "grads": grads, "params": params, "installable": installed}
    return _to_bytes(results)


def _assert_bitwise_same(results):
    ours, theirs = results[True], results[False]
    assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
    for kind in ("grads", "params"):
        assert ours[kind].keys() == theirs[kind].keys()
        for name in ours[kind]:
            assert torch.equal(ours[kind][name], theirs[kind][name]), f"{kind} {name}"


@pytest.mark.slow  # multi-process training runs: the full suite
def test_parallel_direct_comm_trains_bitwise_like_gloo_collectives():
    """On a shard group of 2 the direct exchanges give the same bits as gloo's collectives: 1-D FSDP on 2 ranks
    and HSDP 2 × 2 on 4 (its replicas all-reduce with gloo as before)."""
    for world_size, replicate in ((2, 1), (4, 2)):
        for data in run_distributed(_train_both, world_size, replicate):
            results = torch.load(io.BytesIO(data))
            assert results[True]["installable"] == [True]
            _assert_bitwise_same(results)


def test_parallel_direct_comm_not_for_a_single_process():
    assert not supports_direct_comm(None)
