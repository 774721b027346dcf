"""The `memory_plan` section: each `large_model` run's measured peak over `mmfsdp.train.memory.memory_plan`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import Context


def section_memory_plan(ctx: Context) -> dict[str, Any]:
    if not ctx.memory:
        raise RuntimeError("no large_model run to compare with (that section failed or was skipped)")
    return {"function": "mmfsdp.train.memory.memory_plan(cfg, 1, image_token_share=0.0)",
            "target": "measured_over_plan within [0.75, 1.25] (tests/test_e2e_memory_measured.py's 25 %)",
            **ctx.memory}
