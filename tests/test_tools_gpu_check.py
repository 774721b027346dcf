"""tools/bench/gpu_check.py --cpu: every section runs on the CPU at tiny sizes (the same code paths the GPU run
takes), the process exits 0 and its last stdout line is the JSON object with every section's key. The script runs
as `python SCRIPT --cpu` would, in a process forked with its imports done (`tests/toolrun.py`)."""

import json
import os
from pathlib import Path

import pytest

from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "bench" / "gpu_check.py"
SECTIONS = ("attention", "moe_experts", "bf16_parity", "large_model", "memory_plan", "compile")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def summary():
    run = run_tool(SCRIPT, ["--cpu"], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=580)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_section_runs_on_the_cpu(summary):
    assert summary["mode"] == "cpu" and summary["device_type"] == "cpu"
    for key in ("device", "torch", "transformers", "date", "budget_s", "elapsed_s"):
        assert key in summary
    for name in SECTIONS:
        assert summary[name]["status"] == "ok", (name, summary[name])
        assert summary[name]["seconds"] >= 0


def test_sections_report_their_numbers(summary):
    attention = summary["attention"]
    assert attention["hf_attention_function"] == "mmfsdp_sdpa"
    for layout in ("packed_varlen", "padded"):
        assert attention[layout]["sdpa_ops"] and attention[layout]["kernels_used"] != ["none seen"]
    moe = summary["moe_experts"]
    assert moe["auto_path"] in ("grouped", "loop") and moe["ms"]["loop"] > 0
    if moe["grouped_mm_supported"]:
        assert moe["equal_within_tolerance"]
    parity = summary["bf16_parity"]
    for example in ("tiny_mistral3", "qwen3vl_tiny", "qwen3vl_moe_tiny"):
        assert parity[example]["within_tolerance"], parity[example]
    for seq in ("seq_256", "seq_512"):
        large = summary["large_model"][seq]
        assert large["tokens_per_step"] == int(seq.split("_")[1]) and large["tokens_per_s"] > 0
        assert large["mfu"] > 0 and large["hfu"] > large["mfu"]  # recompute counts a second forward in HFU
        assert 0.75 <= summary["memory_plan"][seq]["measured_over_plan"] <= 1.25
    compiled = summary["compile"]
    assert compiled["within_tolerance"] and compiled["speedup"] > 0


def test_gated_deltanet_section_is_skipped_on_the_cpu_with_the_reason(summary):
    section = summary["gated_deltanet"]
    assert section["status"] == "skipped" and "CUDA" in section["reason"], section


def _run(*args: str) -> dict:
    run = run_tool(SCRIPT, ["--cpu", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_failing_section_is_recorded_and_the_others_run():
    # memory_plan compares with the large_model runs: without them it fails, and says so in its entry
    summary = _run("--sections", "moe_experts,memory_plan")
    assert summary["moe_experts"]["status"] == "ok"
    assert summary["memory_plan"]["status"] == "error" and "large_model" in summary["memory_plan"]["error"]
    for name in set(SECTIONS) - {"moe_experts", "memory_plan"}:
        assert summary[name] == {"status": "skipped", "reason": "not in --sections"}


def test_a_spent_budget_skips_the_remaining_sections():
    summary = _run("--budget-s", "0")
    for name in SECTIONS:
        assert summary[name]["status"] == "skipped" and "budget" in summary[name]["reason"], summary[name]
