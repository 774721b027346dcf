"""A user's mistake through the real app is one clear line naming the file or key, never a traceback.

Config-level mistakes go through the app's `main` in-process with `--check` (what `apps/train CONFIG --check`
runs); a strict-mode bad row and a pickle in a checkpoint go through the real 2-process run, where the error
is raised on every rank and must be printed once (the checkpoint itself is written by the trainer in-process).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import apprun
from apprun import TINY
from mmfsdp.ckpt import COMPLETE_FILENAME
from mmfsdp.train.cli import main

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
    items = {
        "data.dataset_param.dataset_type": "huggingface", f"{BASIC}.dataset": dataset, f"{BASIC}.dataset_dir": data,
        f"{BASIC}.cache_dir": tmp_path / "cache", f"{BASIC}.strict": "true", "training.micro_batch_size": 1,
        "training.train_iters": 1, "training.output_dir": tmp_path / "out",
    }
    proc = apprun.attempt(apprun.command(TINY, items), timeout=220)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if "image_outside_dataset_dir" in line]
    assert len(errors) == 1, output[-4000:]
    assert f"{dataset} row 1: image_outside_dataset_dir: ../outside.png resolves to {tmp_path / 'outside.png'}" in errors[0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_pickle_in_rank_0_pt_is_one_line_printed_once(tmp_path):
    items = {
        f"{BASIC}.dataset_dir": tmp_path / "data", f"{BASIC}.cache_dir": tmp_path / "cache",
        "data.dataset_param.synthetic.num_train": 8, "data.dataset_param.synthetic.num_eval": 2,
        "training.micro_batch_size": 2, "training.train_iters": 1, "training.save_interval": 1,
        "training.save": tmp_path / "ckpt", "training.output_dir": tmp_path / "out",
    }
    apprun.train_in_process(TINY, items)  # the trainer the app's ranks run writes the step-1 checkpoint
    (iteration,) = (tmp_path / "ckpt").glob("iter_*")
    rank_file = iteration / "rank_0.pt"
    torch.save({"loader": Path("/etc")}, rank_file)  # a Python object where tensors belong
    marker = iteration / COMPLETE_FILENAME
    listing = json.loads(marker.read_text())
    listing["files"]["rank_0.pt"] = rank_file.stat().st_size  # the marker rewritten too: only the load can tell
    marker.write_text(json.dumps(listing))

    second = apprun.attempt(apprun.command(TINY, {**items, "training.train_iters": 2}), timeout=180)
    output = second.stdout + second.stderr
    assert second.returncode != 0
    assert "Traceback" not in output and "weights_only" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if str(rank_file) in line]
    assert len(errors) == 1, output[-4000:]
    assert "is not a tensor file" in errors[0]
