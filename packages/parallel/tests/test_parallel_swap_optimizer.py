"""`ShardAdamW` (the trainer's AdamW: updated on the local shards) and `SwapAdamW` (`training.optimizer:
adamw_swap`, the same with its moments on the host) are AdamW, bit for bit.

Single process: the same updates as `torch.optim.AdamW` for foreach, for-loop and
fused settings, any number of buckets, and the standard state-dict layout.
Two gloo ranks with FSDP2: 10 steps of `ShardAdamW` give bitwise the parameters and
moments of `AdamW` dispatched through DTensor (fused and foreach), and of `SwapAdamW`
the losses of AdamW; between steps every moment is a DTensor (with the parameter's
placements), whose local shard lives on the host (pinned where CUDA exists) for
`SwapAdamW`; a DCP checkpoint written at step 5 resumes into `SwapAdamW`, `ShardAdamW`
and `AdamW` with the losses of steps 6-10 of the uninterrupted run.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from mmfsdp.parallel import (
    FSDPPlanConfig, MeshPlan, ParallelConfig, ShardAdamW, SwapAdamW, apply_fsdp, build_parallel_dims,
)
from mmfsdp.parallel.testing import run_distributed

STEPS, RESUME_AT, DIM = 10, 5, 16


@pytest.mark.parametrize("settings", [{"foreach": True}, {"foreach": False}, {"fused": True}, {"foreach": True, "amsgrad": True}])
@pytest.mark.parametrize("swap_times", [None, 1, 3, 100])  # None: ShardAdamW
def test_single_process_updates_equal_adamw(settings, swap_times):
    torch.manual_seed(0)
    shapes = [(7, 5), (3,), (11, 4), (2, 2, 2)]
    start = [torch.randn(shape) for shape in shapes]
    ref = [p.clone().requires_grad_() for p in start]
    ours = [p.clone().requires_grad_() for p in start]
    groups = lambda ps: [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]  # noqa: E731
    reference = torch.optim.AdamW(groups(ref), lr=1e-2, **settings)
    swap = (ShardAdamW(groups(ours), lr=1e-2, **settings) if swap_times is None
            else SwapAdamW(groups(ours), lr=1e-2, swap_times=swap_times, **settings))
    for _ in range(4):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        reference.step()
        swap.step()
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    ref_sd, swap_sd = reference.state_dict(), swap.state_dict()
    assert ref_sd["param_groups"] == swap_sd["param_groups"]
    for key, entry in ref_sd["state"].items():
        assert sorted(entry) == sorted(swap_sd["state"][key])
        assert all(torch.equal(entry[name], swap_sd["state"][key][name]) for name in entry)
    loaded = SwapAdamW(groups([p.clone().requires_grad_() for p in start]), lr=1e-2, swap_times=2, **settings)
    loaded.load_state_dict(ref_sd)
    for key, entry in loaded.state_dict()["state"].items():
        assert all(torch.equal(entry[name], ref_sd["state"][key][name]) for name in entry)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def _build(kind: str, world_size: int, **settings):
    torch.manual_seed(0)
    model = _Net()
    dims = build_parallel_dims(MeshPlan.from_config(ParallelConfig(), world_size), "cpu")
    apply_fsdp(model, FSDPPlanConfig(), dims.fsdp_mesh, ["layers.{*}", "head"])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    settings = settings or {"foreach": True}
    if kind == "adamw":
        return model, torch.optim.AdamW(groups, lr=1e-2, **settings)
    if kind == "shard":
        return model, ShardAdamW(groups, lr=1e-2, **settings)
    return model, SwapAdamW(groups, lr=1e-2, swap_times=3, **settings)


def _train(model, optimizer, rank: int, steps: range, check_host: bool = False) -> list[float]:
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, DIM, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if check_host:
            for state in optimizer.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    assert isinstance(state[name], DTensor), name
                    local = state[name].to_local()
                    assert local.device.type == "cpu", local.device
                    if torch.cuda.is_available():
                        assert local.is_pinned()
    return losses


def _swap_worker(rank: int, world_size: int, ckpt_dir: str):
    results = {}
    model, optimizer = _build("adamw", world_size)
    results["adamw"] = _train(model, optimizer, rank, range(STEPS))
    model, optimizer = _build("swap", world_size)
    results["swap"] = _train(model, optimizer, rank, range(STEPS), check_host=True)

    model, optimizer = _build("swap", world_size)
    _train(model, optimizer, rank, range(RESUME_AT))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=ckpt_dir)
    for kind in ("swap", "shard", "adamw"):
        model, optimizer = _build(kind, world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        results[f"resumed_{kind}"] = _train(model, optimizer, rank, range(RESUME_AT, STEPS), check_host=kind == "swap")
    results["shard_equal"] = {name: _shard_equals_adamw(rank, world_size, settings)
                              for name, settings in (("fused", {"fused": True}), ("foreach", {"foreach": True}))}
    return results


def _shard_equals_adamw(rank: int, world_size: int, settings: dict) -> bool:
    """10 steps of `ShardAdamW` and of `AdamW` (DTensor dispatch) from the same start: every parameter and moment
    bitwise equal, the moments DTensors with the parameter's placements."""
    runs = []
    for kind in ("adamw", "shard"):
        model, optimizer = _build(kind, world_size, **settings)
        losses = _train(model, optimizer, rank, range(STEPS))
        runs.append((losses, model, optimizer))
    (ref_losses, ref_model, ref_opt), (losses, model, optimizer) = runs
    assert losses == ref_losses and losses[0] != losses[-1]
    for (name, ref), param in zip(ref_model.named_parameters(), model.parameters()):
        assert isinstance(param, DTensor) and torch.equal(ref.to_local(), param.to_local()), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got, expected = optimizer.state[param][key], ref_opt.state[ref][key]
            if key != "step":
                assert isinstance(got, DTensor) and got.placements == param.placements, (name, key)
                got, expected = got.to_local(), expected.to_local()
            assert torch.equal(got, expected), (name, key)
    return True


def test_fsdp2_swap_equals_adamw_and_resumes_through_dcp(tmp_path):
    results = run_distributed(_swap_worker, 2, str(tmp_path / "ckpt"))
    for rank_result in results:
        assert rank_result["swap"] == rank_result["adamw"], "per-step losses must be bitwise equal"
        assert rank_result["resumed_swap"] == rank_result["swap"][RESUME_AT:]
        assert rank_result["resumed_shard"] == rank_result["swap"][RESUME_AT:]
        assert rank_result["resumed_adamw"] == rank_result["swap"][RESUME_AT:]
        assert rank_result["shard_equal"] == {"fused": True, "foreach": True}
    assert len(results[0]["swap"]) == STEPS and results[0]["swap"][0] != results[0]["swap"][-1]
