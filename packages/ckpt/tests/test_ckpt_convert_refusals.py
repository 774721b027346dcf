"""`mm-convert` refuses an output directory that is, contains or lies inside an input, `--force` or not.

Every refused call must leave every input file byte-identical (sha256 before and after) and create nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mmfsdp.ckpt.cli import main


def _convert(*argv) -> int:
    return main(["GenericDCPConverter", *map(str, argv)])


def _tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (and the set of directories, as empty hashes)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    """`root/hf` (a toy HF model) and `root/ckpt` (its `hf_to_dcp` conversion: tracker + release/)."""
    root = tmp_path_factory.mktemp("refusals")
    hf = root / "hf"
    hf.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file({"embed_tokens.weight": torch.randn(16, 8, generator=gen), "norm.weight": torch.ones(8)}, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8}))
    (hf / "tokenizer.json").write_text('{"version": "1.0"}')
    assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", root / "ckpt") == 0
    os.symlink(root / "ckpt", root / "link_to_ckpt")
    return root


def _dcp_to_hf_cases(root: Path) -> list[tuple[str, Path, Path, str]]:
    ckpt, release, hf = root / "ckpt", root / "ckpt" / "release", root / "hf"
    return [
        # (what, --load_dir, --save_dir, expected words)
        ("same as load_dir", ckpt, ckpt, "is the same directory as --load_dir"),
        ("same as the checkpoint dir", release, release, "is the same directory as --load_dir"),
        ("parent of the checkpoint dir", release, ckpt, "contains --load_dir"),
        ("parent of both inputs", ckpt, root, "contains --load_dir"),
        ("child of load_dir", ckpt, ckpt / "export", "is inside --load_dir"),
        ("child through ..", ckpt, ckpt / "release" / ".." / "export", "is inside --load_dir"),
        ("same through a symlink", ckpt, root / "link_to_ckpt", "is the same directory as --load_dir"),
        ("same as model_assets_dir", ckpt, hf, "is the same directory as --model_assets_dir"),
        ("child of model_assets_dir", ckpt, hf / "export", "is inside --model_assets_dir"),
    ]


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
def test_dcp_to_hf_refuses_overlapping_output(dirs, capsys, force):
    before = _tree(dirs)
    for what, load, save, words in _dcp_to_hf_cases(dirs):
        argv = ["dcp_to_hf", "--load_dir", load, "--save_dir", save, "--model_assets_dir", dirs / "hf"]
        assert _convert(*argv, *(["--force"] if force else [])) == 2, what
        err = capsys.readouterr().err
        assert err.startswith("mm-convert: error: --save_dir ") and words in err, (what, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert _tree(dirs) == before, what  # nothing replaced, nothing created


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
def test_hf_to_dcp_refuses_overlapping_output(dirs, capsys, force):
    hf = dirs / "hf"
    before = _tree(dirs)
    for out, words in ((hf, "is the same directory as --hf_dir"), (hf / "dcp", "is inside --hf_dir"), (dirs, "contains --hf_dir")):
        assert _convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", out, *(["--force"] if force else [])) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("mm-convert: error: --dcp_dir ") and words in err, err
        assert len(err.strip().splitlines()) == 1
        assert _tree(dirs) == before, out


def test_a_sibling_output_is_still_allowed(dirs, tmp_path):
    assert _convert("dcp_to_hf", "--load_dir", dirs / "ckpt", "--save_dir", tmp_path / "out", "--model_assets_dir", dirs / "hf") == 0
    assert (tmp_path / "out" / "config.json").is_file()
