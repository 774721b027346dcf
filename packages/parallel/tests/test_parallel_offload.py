"""Activation offload: the same losses and gradients as without it, with and without recompute.

`include_cpu=True` makes the hooks copy CPU activations too, so the full
pack/unpack path runs on the CPU. Tolerance: relative 1e-6 (the copies are
exact; the bound leaves room only for a different memory layout of a saved tensor).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mmfsdp.parallel import (
    ActivationOffload,
    FSDPPlanConfig,
    MeshPlan,
    ParallelConfig,
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_fsdp,
    build_parallel_dims,
    is_offloaded,
)
from mmfsdp.parallel.testing import assert_within, run_distributed

DIM, STEPS = 32, 3


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run(*, offload: ActivationOffload | None, recompute: bool, world_size: int = 1, rank: int = 0):
    torch.manual_seed(0)
    model = _Net()
    if recompute:
        apply_activation_checkpointing(model, ["layers.{*}"])
    if offload is not None:
        apply_activation_offload(model, ["layers.{*}"], offload=offload)
        assert all(is_offloaded(layer) for layer in model.layers)
    if world_size > 1:
        dims = build_parallel_dims(MeshPlan.from_config(ParallelConfig(), world_size), "cpu")
        apply_fsdp(model, FSDPPlanConfig(), dims.fsdp_mesh, ["layers.{*}", "head"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(STEPS):
        x = torch.randn(8, 16, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return torch.stack(losses), params


def test_offload_equals_no_offload_with_and_without_recompute():
    for recompute in (False, True):
        ref_losses, ref_params = _run(offload=None, recompute=recompute)
        offload = ActivationOffload(include_cpu=True)
        losses, params = _run(offload=offload, recompute=recompute)
        if recompute:  # only what the checkpoints keep for the recompute: each layer's input
            assert offload.offloaded_bytes == STEPS * len(_Net().layers) * 8 * 16 * DIM * 4
        else:
            assert offload.offloaded_bytes > STEPS * len(_Net().layers) * 8 * 16 * DIM * 4
        assert_within(_rel(losses, ref_losses), 1e-6, "losses")
        assert_within(max(_rel(p, q) for p, q in zip(params, ref_params)), 1e-6, "parameters")


def test_offload_moves_activations_not_parameters():
    model = _Net()
    offload = ActivationOffload(include_cpu=True, min_bytes=1)
    apply_activation_offload(model, ["layers.{*}"], offload=offload)
    model(torch.randn(2, 4, DIM)).backward()
    # per layer: LayerNorm input/mean/rstd, fc1 input, gelu input, fc2 input are activations;
    # fc1/fc2/norm weights are parameters and stay
    param_bytes = sum(p.numel() * p.element_size() for layer in model.layers for p in layer.parameters() if p.ndim == 2)
    assert offload.kept_bytes >= param_bytes
    assert offload.offloaded_bytes >= 3 * (2 * 4 * DIM * 4 + 2 * 4 * 4 * DIM * 4 * 2)
    untouched = ActivationOffload()  # CPU tensors stay where they are by default
    model = _Net()
    apply_activation_offload(model, ["layers.{*}"], offload=untouched)
    model(torch.randn(2, 4, DIM)).backward()
    assert untouched.offloaded_bytes == 0 and untouched.kept_bytes > 0


def _fsdp_worker(rank: int, world_size: int):
    out = {}
    for recompute in (False, True):
        out[f"ref_{recompute}"] = _run(offload=None, recompute=recompute, world_size=world_size, rank=rank)[0]
        offload = ActivationOffload(include_cpu=True)
        out[f"off_{recompute}"] = _run(offload=offload, recompute=recompute, world_size=world_size, rank=rank)[0]
        out[f"bytes_{recompute}"] = offload.offloaded_bytes
    dist.barrier()
    return out


@pytest.mark.slow  # multi-process training runs: the full suite
def test_offload_under_fsdp2_with_and_without_recompute():
    for out in run_distributed(_fsdp_worker, 2):
        for recompute in (False, True):
            assert out[f"bytes_{recompute}"] > 0
            assert_within(_rel(out[f"off_{recompute}"], out[f"ref_{recompute}"]), 1e-6, f"recompute {recompute}")
