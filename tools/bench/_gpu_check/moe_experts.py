"""The `moe_experts` section: one MoE layer's experts, grouped GEMM against the loop fallback."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from .common import MOE_RTOL

if TYPE_CHECKING:
    from .context import Context


def section_moe_experts(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextConfig,
        Qwen3VLMoeTextSparseMoeBlock,
    )

    from mmfsdp.parallel.dtypes import DTYPES
    from mmfsdp.parallel.expert_parallel import _grouped_mm_fits, experts_forward, grouped_mm_supported

    m = ctx.sizes.moe
    device, dtype = ctx.device, DTYPES[m["dtype"]]
    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(
        hidden_size=m["hidden"], moe_intermediate_size=m["intermediate"], num_experts=m["experts"],
        num_experts_per_tok=m["top_k"], experts_implementation="eager"))
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    block = block.to(device, dtype)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(m["tokens"], m["hidden"], generator=generator).to(device, dtype)
    cotangent = torch.randn(m["tokens"], m["hidden"], generator=generator).to(device, dtype)
    with torch.no_grad():
        _, weight, idx = block.gate(hidden)
    experts = block.experts
    supported = grouped_mm_supported(device, dtype)
    fits = _grouped_mm_fits(hidden, experts.gate_up_proj, experts.down_proj)
    out: dict[str, Any] = {
        **m, "grouped_mm_supported": supported, "grouped_mm_fits": fits,
        "auto_path": "grouped" if supported and fits else "loop",
    }

    def step(implementation: str):
        x = hidden.detach().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y = experts_forward(experts, x, idx, weight, implementation=implementation)
        y.backward(cotangent)
        return y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    names = ["loop"] + (["grouped"] if supported else [])
    results = {name: step(name) for name in names}  # warm-up, and the values compared
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(m["repeats"]):
        for name in names:
            ctx.synchronize()
            started = time.perf_counter()
            step(name)
            ctx.synchronize()
            times[name].append(time.perf_counter() - started)
    out["ms"] = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
    if supported:
        rtol = MOE_RTOL[m["dtype"]]
        diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
                 for a, b in zip(results["grouped"], results["loop"])]
        out["max_rel_diff"] = dict(zip(("output", "grad_input", "grad_gate_up", "grad_down"), diffs))
        out["rtol"] = rtol
        out["equal_within_tolerance"] = max(diffs) <= rtol
        out["loop_over_grouped_time"] = round(out["ms"]["loop"] / out["ms"]["grouped"], 3)
    else:
        out["note"] = "grouped GEMM not available for this device and dtype: the loop fallback runs"
    return out
