"""A user's mistake through the real app is one clear line naming the file or key, never a traceback.

Config-level mistakes go through the app's `main` in-process with `--check` (what `apps/train CONFIG --check`
runs); a strict-mode bad row goes through the real 2-process run, where the error is raised on every rank.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmfsdp.train.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
APP = ROOT / "apps" / "train"
BASIC = "data.dataset_param.basic_parameters"


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out, err
    return err


def _huggingface(tmp_path: Path, dataset: Path | str, *extra: str) -> list[str]:
    return [
        TINY, "data.dataset_param.dataset_type=huggingface", f"{BASIC}.dataset={dataset}",
        f"{BASIC}.dataset_dir={tmp_path}", f"{BASIC}.cache_dir={tmp_path / 'cache'}", *extra,
    ]


def test_a_binary_config_file_is_named(tmp_path, capsys):
    png = tmp_path / "photo.png"
    Image.new("RGB", (4, 4)).save(png)
    err = _one_line_error(capsys, [png, "--check"])
    assert err.startswith("config error: config file ") and str(png) in err and "not a UTF-8 text file" in err


def test_a_missing_dataset_file_is_named(tmp_path, capsys):
    err = _one_line_error(capsys, [*_huggingface(tmp_path, tmp_path / "nope.jsonl"), "--check"])
    assert f"{BASIC}.dataset: " in err and "nope.jsonl" in err and "is not a file" in err


def test_a_csv_dataset_file_is_named(tmp_path, capsys):
    csv = tmp_path / "rows.csv"
    csv.write_text("messages,images\n")
    err = _one_line_error(capsys, [*_huggingface(tmp_path, csv), "--check"])
    assert f"{BASIC}.dataset: " in err and "rows.csv" in err and "must be a .json file" in err


def test_an_unknown_dataset_type_suggests_the_closest(capsys):
    err = _one_line_error(capsys, [TINY, "data.dataset_param.dataset_type=huggingfac", "--check"])
    assert "data.dataset_param.dataset_type: unknown dataset type 'huggingfac' (did you mean 'huggingface'?)" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_strict_bad_row_through_the_app_is_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.png", "../outside.png"):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(data / name)
    rows = [{"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "a square"}], "images": [image]}
            for image in ("a.png", "../outside.png", "a.png", "a.png")]
    dataset = data / "train.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "data.dataset_param.dataset_type=huggingface", f"{BASIC}.dataset={dataset}", f"{BASIC}.dataset_dir={data}",
        f"{BASIC}.cache_dir={tmp_path / 'cache'}", f"{BASIC}.strict=true", "training.micro_batch_size=1",
        "training.train_iters=1", f"training.output_dir={tmp_path / 'out'}",
    ]
    proc = subprocess.run([sys.executable, str(APP), str(TINY), *overrides, "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=220, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if "image_outside_dataset_dir" in line]
    assert errors, output[-4000:]
    assert f"{dataset} row 1: image_outside_dataset_dir: ../outside.png resolves to {tmp_path / 'outside.png'}" in errors[0]
