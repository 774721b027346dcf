"""The memory bounds of two benchmarks, measured by the benchmarks' own code (issue 44): per-rank tensor memory
under context parallel (`tools/bench/cp_memory.py`: CP 2 ≤ 0.55 and CP 4 ≤ 0.30 of CP 1) and LoRA over a full
fine-tune (`tools/bench/lora_memory.py`: ≤ 0.5).

Both count tensor bytes with `mmfsdp.parallel.tensor_memory.TensorMemory` (the CPU stand-in for an accelerator's
`max_memory_allocated`), which gives the same number in every run, so the bounds are checked exactly; the resident
set that `cp_memory.py` also reports moves by a few MiB from run to run and holds the process's own growth.
The LoRA case runs the benchmark's default model (the ratio depends on the sizes: a tiny vocabulary makes the
`lm_head` and embedding all-gathers, which set LoRA's peak, unrepresentatively small); the CP case runs the
benchmark's decoder stack at 2048 tokens instead of 8192, where activations dominate as they do at 8192 (its
ratios at 8192 are in docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import cp_memory  # noqa: E402
import lora_memory  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CP_BOUNDS = {2: 0.55, 4: 0.30}
LORA_BOUND = 0.5


def test_cp_tensor_memory_per_rank_shrinks_with_cp():
    sizes = dict(mode="ring", seq_len=2048, hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2)
    worst = {}
    for cp in (1, *CP_BOUNDS):
        ranks = run_distributed(cp_memory._measure, cp, *sizes.values(), timeout=900)
        worst[cp] = max(r["tensor_mib"] for r in ranks)
        assert len({r["loss"] for r in ranks}) == 1
    ratios = {cp: worst[cp] / worst[1] for cp in CP_BOUNDS}
    assert all(ratios[cp] <= bound for cp, bound in CP_BOUNDS.items()), (ratios, worst)


def test_lora_peak_is_at_most_half_the_full_fine_tunes():
    args = lora_memory.DEFAULTS
    preload_for_ranks(*lora_memory.RANK_MODULES)
    ranks = run_distributed(lora_memory._both, args["nproc"], args, timeout=1200)
    peaks = {name: max(r[name]["peak_mib"] for r in ranks) for name in ("full", "lora")}
    assert peaks["lora"] / peaks["full"] <= LORA_BOUND, peaks
