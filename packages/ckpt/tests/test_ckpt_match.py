"""`mmfsdp.ckpt.match`: a checkpoint's keys and shapes against a model's, from metadata only (tied weights,
optimizer entries, adapter-only saves, key maps, HF files through an adapter)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from mmfsdp.ckpt import RenameAdapter, save_checkpoint
from mmfsdp.ckpt.match import check_dcp, check_hf, compare_shapes, expected_shapes


class _Tied(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(hidden))


class _Prefix(RenameAdapter):
    renames = (("backbone.", ""),)


def test_compare_lists_missing_unexpected_and_mismatched():
    report = compare_shapes({"a": (2,), "b": (3, 4), "c": (1,)}, {"b": (4, 3), "c": (1,), "d": (5,)})
    assert (report.missing, report.unexpected, report.mismatched) == (["a"], ["d"], [("b", (3, 4), (4, 3))])
    assert report.counts() == "1 missing, 1 unexpected, 1 shape mismatch" and not report.ok
    many = compare_shapes({f"k{i}": (1,) for i in range(30)}, {})
    assert many.lines(5)[-1] == "... and 25 more (30 missing in all)" and len(many.lines(5)) == 6


def test_dcp_with_optimizer_and_tied_weights_fits(tmp_path):
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    with torch.device("meta"):
        meta = _Tied()
    shapes, aliases = expected_shapes(meta)
    assert sorted(aliases[0]) == ["embed.weight", "head.weight"] and "scale" in shapes
    assert check_dcp(tmp_path / "iter_0000001", shapes, aliases).ok
    with torch.device("meta"):
        wider = _Tied(hidden=12)
    report = check_dcp(tmp_path / "iter_0000001", *expected_shapes(wider))
    assert ("embed.weight", (16, 12), (16, 8)) in report.mismatched and len(report.mismatched) == 5
    assert not report.missing and not report.unexpected


def test_adapter_only_save_and_key_map(tmp_path):
    model = _Tied()
    model.proj.weight.requires_grad_(False)
    save_checkpoint(tmp_path, 1, model=model, trainable_only=True)
    with torch.device("meta"):
        meta = _Tied()
    meta.proj.weight.requires_grad_(False)
    assert check_dcp(tmp_path / "iter_0000001", *expected_shapes(meta, trainable_only=True)).ok
    assert check_dcp(tmp_path / "iter_0000001", *expected_shapes(meta)).missing == ["proj.weight"]
    shapes, _ = expected_shapes(meta, key_map=lambda key: None if key == "scale" else "base." + key)
    assert set(shapes) == {"base.embed.weight", "base.proj.weight", "base.proj.bias", "base.head.weight"}


def test_hf_files_through_an_adapter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    save_file({"backbone.embed.weight": torch.zeros(16, 8), "backbone.proj.weight": torch.zeros(8, 8),
               "backbone.proj.bias": torch.zeros(8), "backbone.scale": torch.zeros(8),
               "backbone.extra": torch.zeros(2)}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = _Tied()
    report = check_hf(tmp_path, *expected_shapes(meta), adapter=_Prefix())
    assert report.missing == [] and report.unexpected == ["backbone.extra"]  # head.weight is tied to embed.weight
