"""What every section of the GPU check shares: the examples it trains, the tolerances, the JSON line's helpers."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = {
    "tiny_mistral3": ROOT / "examples" / "tiny",
    "qwen3vl_tiny": ROOT / "examples" / "qwen3vl-tiny",
    "qwen3vl_moe_tiny": ROOT / "examples" / "qwen3vl-moe-tiny",
}
BF16_RTOL = 2e-2
"""Relative per-step loss tolerance of a bf16-compute run against fp32 (module docstring)."""
FP32_COMPILE_RTOL = 1e-4
"""Compiled vs eager in fp32 (the CPU mode): the same maths in another order."""
MOE_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
GDN_FLA_RTOL = 1e-2
"""fla's Triton kernel against our torch operator, fp32 inputs: its dots may run in TF32 (10 mantissa bits)."""


class SectionSkipped(Exception):
    """A section that cannot run here: recorded as `{"status": "skipped", "reason": ...}`."""


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def error_text(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def rel_diff(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def tidy(value: Any) -> Any:
    """Floats to 5 significant digits for the JSON line (the numbers vary more than that between runs)."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {key: tidy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [tidy(item) for item in value]
    return value


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def compare_losses(losses: list[float], reference: list[float], rtol: float) -> dict[str, Any]:
    rel = [rel_diff(a, b) for a, b in zip(losses, reference)]
    worst = max(range(len(rel)), key=rel.__getitem__) if rel else None
    return {
        "steps": len(rel),
        "max_rel_diff": max(rel) if rel else None,
        "worst_step": None if worst is None else worst + 1,
        "rtol": rtol,
        "within_tolerance": bool(rel) and len(losses) == len(reference) and max(rel) <= rtol,
    }
