"""The `compile` section: the qwen3vl-tiny example eager against `features.compile: true`."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from .common import BF16_RTOL, FP32_COMPILE_RTOL, compare_losses, log

if TYPE_CHECKING:
    from .context import Context


def section_compile(ctx: Context) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    s = ctx.sizes
    steps = s.compile_warmup + s.compile_steps
    dtype = s.compute_dtype
    rtol = BF16_RTOL if dtype == "bf16" else FP32_COMPILE_RTOL
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"features.compile": "true",
                                                      "features.compile_plan.backend": s.compile_backend})):
        log(f"compile: {name} ({s.compile_backend if name == 'compiled' else 'eager'})")
        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", f"compile_{name}", steps=steps, micro_batch=s.micro_batch,
            extra={"parallel.fsdp_plan.param_dtype": dtype, **extra}))
        counters.clear()
        started = time.perf_counter()
        runs[name] = ctx.runs.train(cfg)
        runs[name]["wall_s"] = time.perf_counter() - started
        runs[name]["graphs"] = int(counters["stats"]["unique_graphs"])
    times = {name: [r["step_time_s"] for r in run["records"][s.compile_warmup:]] for name, run in runs.items()}
    eager_ms, compiled_ms = (1000 * statistics.median(times[n]) for n in ("eager", "compiled"))
    return {
        "backend": s.compile_backend, "dtype": dtype, "steps": steps, "warmup": s.compile_warmup,
        **compare_losses(runs["compiled"]["losses"], runs["eager"]["losses"], rtol),
        "eager_step_ms": round(eager_ms, 3), "compiled_step_ms": round(compiled_ms, 3),
        "speedup": round(eager_ms / compiled_ms, 3),
        "first_compiled_step_s": round(runs["compiled"]["records"][0]["step_time_s"], 2),
        "graphs_compiled": runs["compiled"]["graphs"],  # a few: more would mean recompiling for new lengths
        "wall_s": {name: round(run["wall_s"], 1) for name, run in runs.items()},
    }
