"""The `bf16_parity` section: the three tiny examples in fp32 and with bf16 compute, step by step."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

from .common import BF16_RTOL, EXAMPLES, compare_losses, error_text, log

if TYPE_CHECKING:
    from .context import Context


def section_bf16_parity(ctx: Context) -> dict[str, Any]:
    steps, mbs = ctx.sizes.parity_steps, ctx.sizes.micro_batch
    out: dict[str, Any] = {"rtol": BF16_RTOL, "steps": steps, "micro_batch_size": mbs,
                           "bf16": "parallel.fsdp_plan.param_dtype: bf16 (fp32 master weights, fp32 reduce)"}
    for example in EXAMPLES:
        if ctx.out_of_budget():
            out[example] = {"status": "skipped", "reason": ctx.budget_reason()}
            continue
        try:
            losses = {}
            for dtype in ("fp32", "bf16"):
                log(f"bf16_parity: {example} {dtype}")
                cfg = ctx.runs.config(example, ctx.runs.overrides(
                    example, f"parity_{dtype}", steps=steps, micro_batch=mbs,
                    extra={"parallel.fsdp_plan.param_dtype": dtype}))
                losses[dtype] = ctx.runs.train(cfg)["losses"]
            out[example] = {**compare_losses(losses["bf16"], losses["fp32"], BF16_RTOL),
                            "loss_fp32": [round(v, 5) for v in losses["fp32"]],
                            "loss_bf16": [round(v, 5) for v in losses["bf16"]]}
        except Exception as err:
            log(traceback.format_exc())
            out[example] = {"status": "error", "error": error_text(err)}
    out["all_within_tolerance"] = all(v.get("within_tolerance") for k, v in out.items() if k in EXAMPLES)
    return out
