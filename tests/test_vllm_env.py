"""The vLLM environment (`tools/vllm_env`): its setup script, and vLLM generating with an export of ours.

- `setup.py` documents its flags (`-h`); with a stamp that matches the pins it builds nothing (it runs here with no
  uv to call) and `--check` prints the environment's Python; a missing or stale environment is `--check`'s exit 1
  with the command that builds it; a directory that holds something else is refused, never cleared.
- `smoke.py`, run with the vLLM environment's Python (marked `vllm` and `slow`): a tiny Qwen3-VL export made with our
  code (`hf_exports`: a checkpoint saved as the trainer saves one, `mm-convert dcp_to_hf`) loads in `vllm.LLM` on
  the CPU, and its greedy completions (fp32, 8 tokens, the stop tokens of the export's `generation_config.json`) of
  a prompt with an image and a text-only prompt equal transformers' greedy generation of the same directory, token
  for token; vLLM's prompt ids (the image placeholder expanded) equal the HF processor's.

The environment is not part of the workspace's lock: `uv run python tools/vllm_env/setup.py` builds it (`.ci/run`
does, before the tests). Where it is missing the `vllm` test fails, saying so; deselect it with `-m "not vllm"`.
"""

from __future__ import annotations

import importlib.util
import json
import os
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


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_greedy_equals_transformers_on_an_export(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    python = _vllm_python()
    export = hf_exports.export_example(hf_exports.EXAMPLE_CONFIGS["qwen3_vl"], tmp_path)
    image_path = tmp_path / "square.png"
    image = Image.new("RGB", (64, 64), (235, 235, 235))
    image.paste((30, 90, 200), (12, 20, 52, 44))
    image.save(image_path)

    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([python, str(SMOKE), str(export.path), "--image", str(image_path), "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [output["image"] for output in result["outputs"]] == [True, False]

    model = AutoModelForImageTextToText.from_pretrained(export.path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(export.path)
    for output in result["outputs"]:
        inputs = processor(text=[output["prompt"]], images=[Image.open(image_path)] if output["image"] else None,
                           return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == output["prompt_token_ids"]
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert generated[0, inputs["input_ids"].shape[1]:].tolist() == output["token_ids"], output["prompt"]
