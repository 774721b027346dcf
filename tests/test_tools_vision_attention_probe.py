"""tools/probe/vision_attention.py on the CPU: the CLI prints one row per backend and a JSON line last, the
available backends agree with the per-image / per-sequence SDPA reference, and the probe does catch an
attention function that lets images or packed sequences see each other."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "probe" / "vision_attention.py"


def _load_probe():
    spec = importlib.util.spec_from_file_location("vision_attention_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_on_cpu_reports_every_backend_and_json_last():
    run = subprocess.run(
        [sys.executable, str(PROBE), "--device", "cpu", "--trials", "1", "--max-patches", "6", "--max-seq-len", "40"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["dtype"] == "fp32" and summary["ok"]
    for name in ("sdpa", "eager"):
        result = summary["backends"][name]
        assert result["ok"] and max(result[c] for c in ("vision", "varlen_causal", "varlen_full")) <= 1e-5
    assert "unavailable" in summary["backends"]["flash_attention_2"]  # no CPU kernel
    assert (
        "usage"
        in subprocess.run([sys.executable, str(PROBE), "-h"], capture_output=True, text=True, timeout=300).stdout
    )


def _attends_everywhere(module, query, key, value, attention_mask, **kwargs):
    """A broken backend: drops the varlen boundaries and the mask, so every token sees every token."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    kwargs["is_causal"] = False
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)


def test_probe_catches_attention_across_images_and_sequences():
    probe = _load_probe()
    AttentionInterface.register("probe_test_broken", _attends_everywhere)
    AttentionMaskInterface.register("probe_test_broken", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    args = probe._parser().parse_args(["--trials", "1", "--max-patches", "6", "--max-seq-len", "40"])
    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)
    assert probe._vision_diff("mmfsdp_sdpa", cpu, torch.float32, args, gen) <= 1e-5
    assert probe._vision_diff("probe_test_broken", cpu, torch.float32, args, gen) > 1e-2
    assert probe._varlen_diff("probe_test_broken", cpu, torch.float32, False, args, gen) > 1e-2
    assert probe._varlen_diff("probe_test_broken", cpu, torch.float32, True, args, gen) > 1e-2
