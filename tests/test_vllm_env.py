"""The vLLM environment (`tools/vllm_env`): its setup script, and vLLM generating with an export of ours.

- `setup.py` documents its flags (`-h`); with a stamp that matches the pins it builds nothing (it runs here with no
  uv to call) and `--check` prints the environment's Python; a missing or stale environment is `--check`'s exit 1
  with the command that builds it; a directory that holds something else is refused, never cleared.
- `smoke.py`, run with the vLLM environment's Python (marked `vllm` and `slow`): an export of each family made with
  our code (`hf_exports`: a checkpoint saved as the trainer saves one, `mm-convert dcp_to_hf`), all five loaded one
  after the other in one `vllm.LLM` process on the CPU, generates 8 greedy tokens (the stop tokens of the export's
  `generation_config.json`) for a prompt with an image and a text-only prompt; vLLM's prompt ids (the image
  placeholder expanded) equal the HF processor's. mistral3 and qwen3_vl (fp32) and qwen3_5 (bf16: vLLM's CPU Gated
  DeltaNet kernel runs nothing else, and heads of 128 only, so its tiny assets get those) give transformers' greedy
  tokens exactly; the MoE families (qwen3_vl_moe with the `norm_topk_prob` the export now writes, qwen3_5_moe) load
  and generate, not token for token (`GENERATES`).

The environment is not part of the workspace's lock: `uv run python tools/vllm_env/setup.py` builds it (`.ci/run`
does, before the tests). Where it is missing the `vllm` test fails, saying so; deselect it with `-m "not vllm"`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_exports

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tools" / "vllm_env" / "setup.py"
SMOKE = ROOT / "tools" / "vllm_env" / "smoke.py"


def _setup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SETUP), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_setup_help_and_a_matching_stamp_builds_nothing(tmp_path):
    help_text = _setup("-h").stdout
    for flag in ("--env", "--python", "--check", "--force"):
        assert flag in help_text
    env = tmp_path / "env"
    missing = _setup("--check", "--env", str(env))
    assert missing.returncode == 1 and "uv run python tools/vllm_env/setup.py" in missing.stderr
    (tmp_path / "data" / "keep.txt").parent.mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    refused = _setup("--env", str(tmp_path / "data"))  # never cleared to make a virtual environment there
    assert refused.returncode == 1 and "other than a virtual environment" in refused.stderr
    assert (tmp_path / "data" / "keep.txt").read_text() == "mine"

    # A stand-in environment with a matching stamp: nothing is built (no uv to call), --check prints its Python.
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    spec = importlib.util.spec_from_file_location("vllm_env_setup", SETUP)
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    (env / setup.STAMP).write_text(json.dumps(setup.wanted_stamp(setup.PYTHON)))
    no_uv = {"UV": "/nonexistent/uv", "PATH": "/nonexistent"}
    assert _setup("--env", str(env), env=no_uv).stdout.strip() == f"vLLM environment up to date: {env}"
    assert _setup("--check", "--env", str(env), env=no_uv).stdout.strip() == str(env / "bin" / "python")
    assert _setup("--check", "--env", str(env), "--python", "3.12").returncode == 1  # another Python: stale


def _vllm_python() -> str:
    check = _setup("--check")
    if check.returncode != 0:
        pytest.fail(f"{check.stderr.strip()} (or deselect this test: -m 'not vllm')", pytrace=False)
    return check.stdout.strip()


GREEDY_EQUAL = {"mistral3": "float32", "qwen3_vl": "float32", "qwen3_5": "bfloat16"}
"""Families whose export's greedy completions in vLLM equal transformers' token for token, in that dtype (vLLM's CPU
Gated DeltaNet kernel runs bf16 only)."""
GENERATES = {"qwen3_vl_moe": "float32", "qwen3_5_moe": "bfloat16"}
"""Families whose export loads and generates in vLLM, prompt ids equal to the HF processor's, but whose completions
are not transformers' (the MoE blocks' log-probs differ by a few hundredths of a nat on these random models: docs/rl.md,
"The vLLM environment")."""


def _gdn_head_128(family: str, tmp_path: Path) -> Path:
    """The family's tiny assets with Gated DeltaNet heads of 128 (the published models' size): vLLM's CPU kernel takes
    no other."""
    assets = tmp_path / f"{family}-assets"
    shutil.copytree(hf_exports.EXAMPLE_CONFIGS[family].parent / "assets", assets)
    config = json.loads((assets / "config.json").read_text())
    config["text_config"].update(linear_key_head_dim=128, linear_value_head_dim=128)
    (assets / "config.json").write_text(json.dumps(config, indent=2))
    return assets


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_familys_export_generates_in_vllm_as_in_transformers(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    python = _vllm_python()
    exports = {}
    for family in (*GREEDY_EQUAL, *GENERATES):
        assets = _gdn_head_128(family, tmp_path) if family.startswith("qwen3_5") else None
        exports[family] = hf_exports.export_example(hf_exports.EXAMPLE_CONFIGS[family], tmp_path / family,
                                                    assets=assets)
    dtypes = {**GREEDY_EQUAL, **GENERATES}
    image_path = tmp_path / "square.png"
    image = Image.new("RGB", (64, 64), (235, 235, 235))
    image.paste((30, 90, 200), (12, 20, 52, 44))
    image.save(image_path)

    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    models = [f"{exports[family].path}:{dtypes[family]}" for family in exports]
    run = subprocess.run([python, str(SMOKE), *models, "--image", str(image_path), "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=800, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["model"] for line in lines] == [str(exports[family].path) for family in exports]

    for family, result in zip(exports, lines):
        assert [output["image"] for output in result["outputs"]] == [True, False]
        dtype = getattr(torch, dtypes[family])
        model = AutoModelForImageTextToText.from_pretrained(exports[family].path, dtype=dtype).eval()
        processor = AutoProcessor.from_pretrained(exports[family].path)
        for output in result["outputs"]:
            inputs = processor(text=[output["prompt"]], images=[Image.open(image_path)] if output["image"] else None,
                               return_tensors="pt")
            assert inputs["input_ids"][0].tolist() == output["prompt_token_ids"], family
            assert len(output["token_ids"]) == 8, (family, output)
            if family in GREEDY_EQUAL:
                with torch.no_grad():
                    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
                assert generated[0, inputs["input_ids"].shape[1]:].tolist() == output["token_ids"], (family, output)
