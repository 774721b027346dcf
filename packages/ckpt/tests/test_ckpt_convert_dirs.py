"""`mm-convert GenericDCPConverter dcp_to_hf --load_dir`: a training save directory (its tracker), an `iter_*`
directory, and a missing `release` (or iteration) inside a save directory, which names what is there and the
command that works."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from mmfsdp.ckpt import SafetensorsDir, save_checkpoint
from mmfsdp.ckpt.cli import main
from mmfsdp.ckpt.layout import TRACKER_FILENAME


class _Toy(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(scale)


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> Path:
    """A training save directory with iterations 4 and 8 (model + AdamW state), the tracker naming 8."""
    root = tmp_path_factory.mktemp("convert_dirs")
    (root / "assets").mkdir()
    (root / "assets" / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8}))  # identity naming
    for iteration in (4, 8):
        model = _Toy(float(iteration))
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        save_checkpoint(root / "save", iteration, model=model, optimizer=optimizer, app_state={"step": iteration})
    return root / "save"


def _export(capsys, load_dir: Path, out: Path, assets: Path) -> tuple[int, str]:
    code = main(["GenericDCPConverter", "dcp_to_hf", "--load_dir", str(load_dir), "--save_dir", str(out),
                 "--model_assets_dir", str(assets)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip()


def _weight(out: Path) -> float:
    weights = SafetensorsDir(out)
    assert set(weights.tensors) == {"embed.weight", "proj.weight", "proj.bias"}  # the model only, no optimizer
    return weights.read("proj.weight")[0, 0].item()


def test_save_directory_exports_the_tracker_iteration(capsys, save_dir, tmp_path):
    code, err = _export(capsys, save_dir, tmp_path / "hf", save_dir.parent / "assets")
    assert code == 0, err
    assert _weight(tmp_path / "hf") == 8.0


def test_iter_directory_exports_that_iteration(capsys, save_dir, tmp_path):
    code, err = _export(capsys, save_dir / "iter_0000004", tmp_path / "hf", save_dir.parent / "assets")
    assert code == 0, err
    assert _weight(tmp_path / "hf") == 4.0


def test_missing_release_names_the_iterations_and_the_command(capsys, save_dir, tmp_path):
    out = tmp_path / "hf"
    code, err = _export(capsys, save_dir / "release", out, save_dir.parent / "assets")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"mm-convert: error: checkpoint directory {save_dir / 'release'} does not exist")
    assert f"{save_dir} holds iter_0000004, iter_0000008 (its tracker names 8), no release" in err
    command = shlex.split(err.split("; run: ")[1])
    assert command == ["mm-convert", "GenericDCPConverter", "dcp_to_hf", "--load_dir", str(save_dir),
                       "--save_dir", str(out), "--model_assets_dir", str(save_dir.parent / "assets")]
    assert main(command[1:]) == 0 and _weight(out) == 8.0  # the suggested command works as printed


def test_missing_iteration_inside_a_save_directory(capsys, save_dir, tmp_path):
    code, err = _export(capsys, save_dir / "iter_0000009", tmp_path / "hf", save_dir.parent / "assets")
    assert code == 2 and "iter_0000009 does not exist" in err and "holds iter_0000004, iter_0000008" in err
    assert f"--load_dir {save_dir} " in err


def test_save_directory_without_its_tracker_points_at_the_newest_iteration(capsys, save_dir, tmp_path):
    lonely = tmp_path / "lonely"  # the same iterations, without a tracker
    lonely.mkdir()
    for name in ("iter_0000004", "iter_0000008"):
        (lonely / name).symlink_to(save_dir / name, target_is_directory=True)
    code, err = _export(capsys, lonely, tmp_path / "hf", save_dir.parent / "assets")
    assert code == 2 and f"has no {TRACKER_FILENAME}" in err and f"no {TRACKER_FILENAME})" in err
    assert f"--load_dir {lonely / 'iter_0000008'} " in err


def test_missing_directory_elsewhere_keeps_the_plain_message(capsys, tmp_path):
    code, err = _export(capsys, tmp_path / "nowhere", tmp_path / "hf", tmp_path)
    assert code == 2 and err == (f"mm-convert: error: checkpoint directory {tmp_path / 'nowhere'} does not exist; "
                                 "check training.load / --load_dir")
