"""Every script under tools/ runs in CI, in its smallest mode.

`SMOKE` names each script's smallest command: a bench script's `--smoke` (the same code as its full run at tiny
sizes, 2 processes where it spawns ranks), the others on tiny generated inputs. Each runs as `python SCRIPT ARGS`
from the repository root with one thread, in its own process forked with torch and transformers already imported
(`tests/toolrun.py`); it must exit 0 and print one JSON line last holding the listed keys with values of the listed
types. A new script under tools/ fails `test_every_tool_has_a_smoke_case` until it is given a row here
(or is listed as an imported helper, or as covered by a named test elsewhere). The vision-attention probe keeps its
own checks: its CPU backends agree with the reference, and it catches a backend that attends across images.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import runpy
import sys
from pathlib import Path

import pytest

from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]
NUMBER = (int, float)
TIMEOUT_S = 300

SMOKE: dict[str, tuple[tuple[str, ...], dict[str, type | tuple[type, ...]]]] = {
    "tools/bench/activation_offload.py": (
        ("--smoke",),
        {"saved_mib_plain": NUMBER, "saved_mib_offload": NUMBER, "saved_ratio": NUMBER, "offloaded_mib": NUMBER,
         "loss_rel_diff": NUMBER},
    ),
    "tools/bench/balance.py": (
        ("--smoke",),
        {"straggler_64_balanced": NUMBER, "padding_fraction_balanced": NUMBER, "calibration_r2": NUMBER,
         "calibrated_cost_model": dict, "wall_ratio_2": NUMBER, "cost_model_correlation_2": NUMBER},
    ),
    "tools/bench/balance_calibrate.py": (("--smoke",), {"token": NUMBER, "patch": NUMBER, "r2": NUMBER}),
    "tools/bench/chunk_loss.py": (
        ("--smoke",),
        {"peak_mem_ratio": NUMBER, "time_ratio": NUMBER, "loss_rel_diff": NUMBER, "grad_norm_rel_diff": NUMBER,
         "plain": dict, "chunked": dict, "config": dict},
    ),
    "tools/bench/convert_throughput.py": (
        ("--smoke",),
        {"size_gb": NUMBER, "hf_to_dcp_vs_cp": NUMBER, "dcp_to_hf_vs_cp": NUMBER},
    ),
    "tools/bench/cp_hybrid.py": (
        ("--smoke",),
        {"mem_ratio_cp2": NUMBER, "saved_ratio_cp2": NUMBER, "time_ratio_cp2": NUMBER, "loss_rel_diff": NUMBER,
         "targets": dict, "targets_met": bool},
    ),
    "tools/bench/cp_memory.py": (
        ("--smoke",), {"mem_ratio_cp2": NUMBER, "saved_ratio_cp2": NUMBER, "tensor_ratio_cp2": NUMBER}
    ),
    "tools/bench/data_prep.py": (
        ("--smoke", "--work-dir", "{tmp}"),
        {"rows": list, "peak_rss_mib": list, "rows_per_s": list, "rss_ratio_1m_over_100k": NUMBER, "runs": dict},
    ),
    "tools/bench/data_throughput.py": (
        ("--smoke", "--work-dir", "{tmp}"),
        {"ratio": NUMBER, "ours_samples_per_s": NUMBER, "baseline_samples_per_s": NUMBER,
         "loader_samples_per_s": NUMBER, "keeps_step_fed": bool, "tokens_per_sample": int, "video_ratio": NUMBER,
         "video_tokens_per_sample": int, "audio_ratio": NUMBER, "audio_tokens_per_sample": int,
         "audio_hf_tokens_per_sample": int},
    ),
    "tools/bench/dpo_memory.py": (
        ("--smoke",),
        {"dpo_lora_over_sft_lora": NUMBER, "dpo_precomputed_over_sft_full": NUMBER, "dpo_frozen_over_sft_full": NUMBER,
         "targets_met": bool},
    ),
    "tools/bench/fsdp_grouping.py": (("--smoke",), {"grouped": dict, "ungrouped": dict, "grouped_speedup": NUMBER}),
    "tools/bench/gated_deltanet.py": (
        ("--smoke",),
        {"device": str, "cases": dict, "worst_time_ratio": NUMBER, "worst_mem_ratio": NUMBER},
    ),
    "tools/bench/grpo_step.py": (
        ("--smoke",),
        {"grpo": dict, "sft": dict, "grpo_over_sft_peak": NUMBER},
    ),
    "tools/bench/host_syncs.py": (("--smoke",), {"qwen3_5": dict}),
    "tools/bench/llamafactory_run.py": (
        ("--smoke",),
        {"llamafactory": str, "command": list, "train_args": dict, "model_files": list, "dataset_info": dict},
    ),
    "tools/bench/load_memory.py": (
        ("--smoke",),
        {"model_mb": NUMBER, "meta_over_eager_rss": NUMBER, "meta_over_eager_peak_rss": NUMBER},
    ),
    "tools/bench/lora_memory.py": (
        ("--smoke",),
        {"full_peak_mib": NUMBER, "lora_peak_mib": NUMBER, "lora_over_full_peak": NUMBER},
    ),
    "tools/bench/moe_dispatch.py": (
        ("--smoke",),
        {"speedup_vs_hf": NUMBER, "max_relative_diff_vs_hf": dict, "expert_param_bytes_per_rank_ratio": dict,
         "gpu_command": str},
    ),
    "tools/bench/rollout.py": (
        ("--smoke",),
        {"hf_tokens_per_s": NUMBER, "vllm_tokens_per_s": NUMBER, "vllm_over_hf": NUMBER, "sync_s": NUMBER,
         "sync_gbps": NUMBER, "copy_s": NUMBER, "sync_over_copy_time": NUMBER, "server_reload_s": NUMBER,
         "kernel_s": NUMBER, "kernel_floor_over_copy_time": NUMBER, "target_reachable": bool, "targets_met": bool},
    ),
    "tools/bench/train_throughput.py": (
        ("--smoke", "--out", "{tmp}"),
        {"tiny": dict, "tiny_over_plain": NUMBER, "tiny_best_over_plain": NUMBER, "tiny_no_direct_over_plain": NUMBER,
         "tiny_direct_gain": NUMBER, "llamafactory": str},
    ),
    "tools/bench/vision_dp.py": (
        ("--smoke",),
        {"share_cost_cp2": NUMBER, "time_ratio_cp2": NUMBER, "bytes_ratio_cp2": NUMBER, "vision_ratio_cp2": NUMBER},
    ),
    "tools/suite_profile.py": (
        ("--smoke", "--top", "5"),
        {"pytest_exit": int, "wall_s": NUMBER, "busy_cpu_s": NUMBER, "sampled_cpu_s": NUMBER, "files": list,
         "self": list},
    ),
    "tools/suite_timings.py": (
        ("--smoke",),
        {"wall_s": NUMBER, "pytest_exit": int, "files": int, "sum_s": NUMBER, "longest": dict},
    ),
    "tools/tolerance_margins.py": (
        ("--smoke",),
        {"cpu": str, "torch": str, "pytest_exit": int, "records": int, "tests": int, "tightest": list},
    ),
    "tools/data/llava_instruct_to_mllm.py": (
        ("--input", "{tmp}/llava.json", "--image-dir", "{tmp}/coco", "--dataset-dir", "{tmp}",
         "--output", "{tmp}/out.jsonl", "--check-images"),
        {"rows": int, "written": int, "dropped": dict, "output": str},
    ),
    "tools/probe/vision_attention.py": (
        ("--device", "cpu", "--trials", "1", "--max-patches", "6", "--max-seq-len", "40"),
        {"device": str, "dtype": str, "backends": dict, "worst": NUMBER, "ok": bool},
    ),
}
"""Script → (its arguments after the path, `{tmp}` being the test's temporary directory; the keys of its last
line's JSON and their types)."""

NEEDS_VLLM = {"tools/bench/rollout.py"}
"""Scripts that run the vLLM environment's server: their smoke case is marked `vllm` (`.ci/run` builds the
environment; elsewhere `-m "not vllm"` deselects it, and without the environment the script says how to build it)."""

HELPERS = {
    "tools/bench/_smoke.py": "imported by the bench scripts: their `--smoke` flag",
    "tools/suite_profile/sitecustomize.py": "loaded by every process tools/suite_profile.py runs: the sampler",
    **{
        f"tools/bench/_gpu_check/{name}.py": "imported by tools/bench/gpu_check.py: its sections and their helpers"
        for name in (
            "__init__", "attention", "bf16_parity", "common", "compile", "context", "gated_deltanet", "large_model",
            "memory_plan", "moe_experts",
        )
    },
}
COVERED_ELSEWHERE = {
    "tools/gen_config_reference.py": (
        "apps/train/tests/test_train_check.py", "test_gen_config_reference_help_and_check",
    ),
    "tools/bench/gpu_check.py": ("tests/test_tools_gpu_check.py", "test_every_section_runs_on_the_cpu"),
    "tools/vllm_env/setup.py": ("tests/test_vllm_env.py", "test_setup_help_and_a_matching_stamp_builds_nothing"),
    "tools/vllm_env/smoke.py": ("tests/test_vllm_env.py", "test_every_familys_export_generates_in_vllm_as_in_transformers"),
}
"""Scripts run by another test (file, test name): gen_config_reference's `--check` is its smallest mode; gpu_check's
is `--cpu`, whose sections that test checks one by one; the vLLM environment's scripts run outside the workspace's
environment (setup.py with a stand-in environment, smoke.py with vLLM's Python)."""


def _llava_inputs(tmp: Path) -> None:
    """Three LLaVA rows: one to convert, one whose image is missing, one with an unknown speaker."""
    (tmp / "coco").mkdir()
    (tmp / "coco" / "a.jpg").write_bytes(b"")
    turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]
    rows = [{"id": 1, "image": "a.jpg", "conversations": turns}, {"id": 2, "image": "gone.jpg", "conversations": turns},
            {"id": 3, "image": "a.jpg", "conversations": [{"from": "robot", "value": "beep"}]}]
    (tmp / "llava.json").write_text(json.dumps(rows))


def _check_llava(result: dict, tmp: Path) -> None:
    assert result["rows"] == 3 and result["written"] == 1
    assert result["dropped"] == {"image file missing": 1, "no usable conversation": 1}
    (row,) = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
    assert row["images"] == ["coco/a.jpg"] and [m["role"] for m in row["messages"]] == ["user", "assistant"]


def _check_probe(result: dict, tmp: Path) -> None:
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["ok"]
    for name in ("sdpa", "eager"):
        backend = result["backends"][name]
        assert backend["ok"] and max(backend[c] for c in ("vision", "varlen_causal", "varlen_full")) <= 1e-5
    assert "unavailable" in result["backends"]["flash_attention_2"]  # no CPU kernel


def _check_suite_profile(result: dict, tmp: Path) -> None:
    assert result["pytest_exit"] == 0 and result["sampled_cpu_s"] > 0
    assert "tests/test_import_graph.py" in dict(result["files"])  # the samples are charged to the test that ran


def _check_suite_timings(result: dict, tmp: Path) -> None:
    assert result["pytest_exit"] == 0 and result["files"] == 1 and result["written"] is None


def _check_cp_hybrid(result: dict, tmp: Path) -> None:
    assert result["loss_rel_diff"] <= 1e-5  # the ring CP stack computes the CP = 1 loss (fp32)
    assert set(result["targets"]) == {"mem_ratio_cp2", "saved_ratio_cp2", "time_ratio_cp2"}


def _check_tolerance_margins(result: dict, tmp: Path) -> None:
    assert result["pytest_exit"] == 0 and result["records"] > 0 and 0 < len(result["tightest"]) <= result["tests"]
    margins = [row["margin"] for row in result["tightest"]]
    assert all(m is None or m >= 1 for m in margins) and margins == sorted(margins, key=lambda m: math.inf if m is None else m)


def _check_data_throughput(result: dict, tmp: Path) -> None:
    assert result["video_tokens_per_sample"] == result["video_hf_tokens_per_sample"]  # the same clips, the same tokens
    assert result["audio_tokens_per_sample"] == result["audio_hf_tokens_per_sample"]


INPUTS = {"tools/data/llava_instruct_to_mllm.py": _llava_inputs}
CHECKS = {
    "tools/bench/cp_hybrid.py": _check_cp_hybrid,
    "tools/bench/data_throughput.py": _check_data_throughput,
    "tools/data/llava_instruct_to_mllm.py": _check_llava,
    "tools/probe/vision_attention.py": _check_probe,
    "tools/suite_profile.py": _check_suite_profile,
    "tools/suite_timings.py": _check_suite_timings,
    "tools/tolerance_margins.py": _check_tolerance_margins,
}


def test_every_tool_has_a_smoke_case():
    scripts = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tools").rglob("*.py")}
    assert scripts == set(SMOKE) | set(HELPERS) | set(COVERED_ELSEWHERE)
    for test_file, test_name in COVERED_ELSEWHERE.values():
        assert f"def {test_name}(" in (ROOT / test_file).read_text()


def _check_types(result: dict, keys: dict) -> None:
    for key, kind in keys.items():
        assert key in result, f"{key} missing from {sorted(result)}"
        value = result[key]
        assert isinstance(value, kind) and not (kind is NUMBER and isinstance(value, bool)), f"{key}: {value!r}"
        assert kind is not NUMBER or math.isfinite(value), f"{key}: {value!r}"


@pytest.mark.slow  # ~200 CPU-seconds in all (forked: no imports each); ~50 in train_throughput, ~50 wall in rollout
@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.vllm) if s in NEEDS_VLLM else s for s in sorted(SMOKE)]
)
def test_smoke(script, tmp_path):
    args, keys = SMOKE[script]
    if script in INPUTS:
        INPUTS[script](tmp_path)
    run = run_tool(script, [arg.format(tmp=tmp_path) for arg in args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                   timeout=TIMEOUT_S)
    output = f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert run.returncode == 0, f"{' '.join(run.args)} exited {run.returncode}:\n{output}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    _check_types(result, keys)
    if script in CHECKS:
        CHECKS[script](result, tmp_path)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_help(script, capsys, monkeypatch):
    """`-h` answers (in this process: the scripts' imports are paid once), and a bench script documents `--smoke`."""
    path = ROOT / script
    monkeypatch.setattr(sys, "argv", [str(path), "-h"])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out and ("--smoke" in out or not script.startswith("tools/bench/")), out


def _load_probe():
    spec = importlib.util.spec_from_file_location("vision_attention_probe", ROOT / "tools/probe/vision_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _attends_everywhere(module, query, key, value, attention_mask, **kwargs):
    """A broken backend: drops the varlen boundaries and the mask, so every token sees every token."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    kwargs["is_causal"] = False
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)


def test_probe_catches_attention_across_images_and_sequences():
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    probe = _load_probe()
    AttentionInterface.register("probe_test_broken", _attends_everywhere)
    AttentionMaskInterface.register("probe_test_broken", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    args = probe._parser().parse_args(["--trials", "1", "--max-patches", "6", "--max-seq-len", "40"])
    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)
    assert probe._vision_diff("mmfsdp_sdpa", cpu, torch.float32, args, gen) <= 1e-5
    assert probe._vision_diff("probe_test_broken", cpu, torch.float32, args, gen) > 1e-2
    assert probe._varlen_diff("probe_test_broken", cpu, torch.float32, False, args, gen) > 1e-2
    assert probe._varlen_diff("probe_test_broken", cpu, torch.float32, True, args, gen) > 1e-2
