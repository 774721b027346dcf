"""The `gated_deltanet` section: fla's Gated DeltaNet kernel against our torch operator, and the device's host round
trips of a packed training micro-batch (module docstring of `tools/bench/gpu_check.py`)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from .common import GDN_FLA_RTOL, SectionSkipped

if TYPE_CHECKING:
    from .context import Context


def section_gated_deltanet(ctx: Context) -> dict[str, Any]:
    import torch

    from mmfsdp.model.gated_delta_rule import (
        SegmentPlan,
        _fla_chunk,
        _fla_gated_delta_rule,
        chunk_gated_delta_rule_packed,
        resolve_gdn_kernel,
    )
    from mmfsdp.model.host_sync_probe import probe_training_step

    runs, why = resolve_gdn_kernel("fla", ctx.device.type)
    if runs != "fla" or _fla_chunk() is None:
        raise SectionSkipped(f"fla's Gated DeltaNet kernel cannot run here: {why}")
    g = ctx.sizes.gdn
    out: dict[str, Any] = {**g}
    generator = torch.Generator().manual_seed(0)
    layouts = {"packed": g["value_heads"], "ulysses2_local_heads": g["value_heads"] // 2}
    for name, value_heads in layouts.items():
        key_heads = value_heads * g["key_heads"] // g["value_heads"]
        T, d = g["tokens"], g["head_dim"]
        length = T // g["samples"]
        plan = SegmentPlan([i * length for i in range(g["samples"])], [length] * g["samples"], 1, ctx.device)
        inputs = [
            torch.randn(T, key_heads, d, generator=generator), torch.randn(T, key_heads, d, generator=generator),
            torch.randn(T, value_heads, d, generator=generator), -torch.rand(T, value_heads, generator=generator) * 0.5,
            torch.rand(T, value_heads, generator=generator),
        ]
        inputs = [x.to(ctx.device).requires_grad_() for x in inputs]
        cotangent = torch.randn(T, value_heads, d, generator=generator).to(ctx.device)

        def step(kernel: str):
            for x in inputs:
                x.grad = None
            if kernel == "fla":
                y, _ = _fla_gated_delta_rule(*inputs, plan.cu_seqlens, None)
            else:
                y, _ = chunk_gated_delta_rule_packed(*inputs, plan.starts, plan.lens, plan=plan)
            (y * cotangent).sum().backward()
            return [y.detach(), *(x.grad for x in inputs)]

        results = {kernel: step(kernel) for kernel in ("fla", "torch")}
        diffs = [((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()
                 for a, b in zip(results["fla"], results["torch"])]
        times: dict[str, list[float]] = {"fla": [], "torch": []}
        for _ in range(g["repeats"]):
            for kernel in times:
                ctx.synchronize()
                started = time.perf_counter()
                step(kernel)
                ctx.synchronize()
                times[kernel].append(time.perf_counter() - started)
        ms = {kernel: round(1000 * statistics.median(t), 3) for kernel, t in times.items()}
        out[name] = {
            "value_heads": value_heads, "ms": ms, "torch_over_fla_time": round(ms["torch"] / ms["fla"], 3),
            "max_rel_diff": dict(zip(("output", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta"), diffs)),
            "within_tolerance": max(diffs) <= GDN_FLA_RTOL,
        }
    out["ring"] = "the ring chains each chunk's state transition through the torch operator: fla does not run there"
    counts = {}
    for model_id in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        counter = probe_training_step(model_id, device=ctx.device, device_only=True)
        counts[model_id] = {"total": counter.total, "in_layers": sum(counter.in_layers.values()),
                            "report": counter.report()}
    out["host_syncs_device"] = counts
    return out
