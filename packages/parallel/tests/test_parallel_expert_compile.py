"""The expert path under `torch.compile` (aot_eager, fp32 on the CPU) against eager.

Grouped GEMM can run eagerly where the op's meta kernel, which torch.compile traces with, refuses the dtype (fp32
on this torch): `grouped_mm_supported(..., compiled=True)` says what works under compile, and `local_experts`
asks it while being traced, so a compiled `local_experts` in fp32 takes the loop and gives eager's numbers. A
compiled block around `experts_forward` (the forward `apply_expert_parallel` installs) runs the dispatch eagerly
and compiles no new graph when the routing, and so every count, changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from mmfsdp.parallel.expert_parallel import experts_forward, grouped_mm_supported, local_experts, tokens_per_expert
from mmfsdp.parallel.testing import assert_within

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 8, 2
TOLERANCE = 1e-5
CPU = torch.device("cpu")


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


class _MoEBlock(nn.Module):
    """Router (softmax top-k) and fused experts, called as HF's MoE block calls its experts."""

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.gate = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, generator=generator) / HIDDEN**0.5)
        self.gate_up_proj = nn.Parameter(
            torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
        )
        self.down_proj = nn.Parameter(
            torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
        )
        self.act_fn = F.silu

    def forward(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        probs_TE = F.linear(hidden_TH, self.gate).softmax(-1)
        weight_TK, idx_TK = probs_TE.topk(TOP_K, dim=-1)
        return hidden_TH + experts_forward(self, hidden_TH * 2, idx_TK, weight_TK / weight_TK.sum(-1, keepdim=True))


def _step(block: nn.Module, forward, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    block.zero_grad()
    hidden = hidden.clone().requires_grad_()
    out = forward(hidden)
    out.square().sum().backward()
    return {"out": out.detach(), "hidden": hidden.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}


def test_grouped_mm_under_compile_implies_eager_support():
    for dtype in (torch.float32, torch.bfloat16):
        if grouped_mm_supported(CPU, dtype, compiled=True):
            assert grouped_mm_supported(CPU, dtype)
    assert not grouped_mm_supported(torch.device("meta"), torch.float32, compiled=True)


def test_compiled_local_experts_in_fp32_match_eager():
    """Traced with dynamic shapes: before `compiled=True` the fp32 trace chose grouped GEMM (eager supports it on
    this torch) and failed in its meta kernel."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 2 * INTERMEDIATE, HIDDEN, generator=generator).requires_grad_()
    down = torch.randn(4, HIDDEN, INTERMEDIATE, generator=generator).requires_grad_()
    x = torch.randn(11, HIDDEN, generator=generator).requires_grad_()
    counts = [3, 0, 6, 2]

    def run(fn):
        for tensor in (x, gate_up, down):
            tensor.grad = None
        out = fn(x, counts, gate_up, down, F.silu)
        out.square().sum().backward()
        return [out.detach(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone()]

    torch._dynamo.reset()
    compiled = run(torch.compile(local_experts, backend="aot_eager", dynamic=True))
    for got, expected in zip(compiled, run(local_experts)):
        assert_within(_relative(got, expected), TOLERANCE, "compiled vs eager")


def test_compiled_grouped_request_names_compile_when_the_trace_cannot_take_it():
    if grouped_mm_supported(CPU, torch.float32, compiled=True):
        pytest.skip("grouped GEMM traces in fp32 on this torch: nothing to refuse")
    x, gate_up, down = torch.randn(4, HIDDEN), torch.randn(2, 2 * INTERMEDIATE, HIDDEN), torch.randn(2, HIDDEN, 8)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *args: local_experts(*args, implementation="grouped"), backend="aot_eager", fullgraph=True
    )
    with pytest.raises(Exception, match="under torch.compile"):
        compiled(x, [1, 3], gate_up, down, F.silu)


def test_compiled_block_with_experts_forward_matches_eager_without_recompiling():
    block = _MoEBlock(seed=3)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block.forward, backend="aot_eager", dynamic=True)
    graphs, routings = [], set()
    for index, num_tokens in enumerate((9, 14, 5, 17, 11, 8)):
        hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(10 + index))
        expected, got = _step(block, block.forward, hidden), _step(block, compiled, hidden)
        for what, value in expected.items():
            assert_within(_relative(got[what], value), TOLERANCE, f"call {index + 1}: {what}")
        graphs.append(int(counters["stats"]["unique_graphs"]))
        _, idx = F.linear(hidden, block.gate).topk(TOP_K, dim=-1)
        routings.add(tuple(tokens_per_expert(idx, NUM_EXPERTS).tolist()))
    assert len(routings) == 6, "each call should route differently"
    # the router before the experts and the residual after them; a second length may add one variant
    assert graphs[-1] <= 4 and graphs[2] == graphs[-1], f"graphs after each call: {graphs}"
