"""Damaged checkpoints (single process): each damage is one `CheckpointError` line naming the file and
what to do; a run never starts over next to whole iterations; `fallback` is the only way past a damaged
latest checkpoint, and it says so."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from mmfsdp.ckpt import (
    COMPLETE_FILENAME,
    CheckpointError,
    find_resume_point,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    verify_checkpoint,
)


def _saved(tmp_path: Path, iterations=(2, 4)) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    save = tmp_path / "ckpt"
    for iteration in iterations:
        save_checkpoint(save, iteration, model=model, optimizer=optimizer, app_state={"step": iteration},
                        rank_state={"loader": {"position": iteration}})
    return save


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    assert "weights_only" not in text
    return text


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


def test_every_saved_iteration_has_a_marker_and_verifies(tmp_path):
    save = _saved(tmp_path)
    for name in ("iter_0000002", "iter_0000004"):
        files = json.loads((save / name / COMPLETE_FILENAME).read_text())["files"]
        assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
        assert verify_checkpoint(save / name) is None
    point = find_resume_point(save)
    assert (point.iteration, point.note) == (4, None)


def test_truncated_shard_is_one_line_naming_the_file(tmp_path):
    save = _saved(tmp_path)
    shard = _shard(save / "iter_0000004")
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    text = _one_line(err)
    assert str(shard) in text and "truncated" in text and "training.resume_fallback: true" in text and "iter 2" in text


def test_truncated_shard_caught_by_dcp_load_is_one_line(tmp_path):
    """Without the marker's help (same size, damaged bytes) DCP's own read fails: still one line."""
    save = _saved(tmp_path, iterations=(2,))
    shard = _shard(save / "iter_0000002")
    shard.write_bytes(b"\0" * shard.stat().st_size)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(save, model=model, load_optim=False)
    assert "iter_0000002" in _one_line(err)


def test_damaged_rank_state_is_one_line(tmp_path):
    save = _saved(tmp_path)
    rank_file = save / "iter_0000004" / "rank_0.pt"
    rank_file.write_bytes(b"x" * rank_file.stat().st_size)  # same size: only reading it can tell
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    text = _one_line(err)
    assert str(rank_file) in text and "damaged" in text and "restore" in text.lower()


def test_pickle_in_rank_state_is_refused_without_suggesting_weights_only_false(tmp_path):
    save = _saved(tmp_path)
    rank_file = save / "iter_0000004" / "rank_0.pt"
    torch.save({"loader": Path("/etc")}, rank_file)  # a Python object, not tensors and plain containers
    marker = save / "iter_0000004" / COMPLETE_FILENAME
    files = json.loads(marker.read_text())
    files["files"]["rank_0.pt"] = rank_file.stat().st_size  # the attacker rewrote the marker too
    marker.write_text(json.dumps(files))
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    text = _one_line(err)
    assert str(rank_file) in text and "not a tensor file" in text


def test_damaged_metadata_is_one_line(tmp_path):
    save = _saved(tmp_path)
    metadata = save / "iter_0000004" / ".metadata"
    metadata.write_bytes(pickle.dumps("garbage").ljust(metadata.stat().st_size, b"."))
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert str(metadata) in _one_line(err)
    metadata.write_bytes(b"\x80\x05garbage".ljust(metadata.stat().st_size, b"\xff"))
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert str(metadata) in _one_line(err)


def test_missing_tracker_resumes_from_the_newest_whole_iteration(tmp_path):
    save = _saved(tmp_path)
    (save / "latest_checkpointed_iteration.txt").unlink()
    point = find_resume_point(save)
    assert point.iteration == 4 and "missing" in point.note and "iter_0000004" in point.note
    # the newest is damaged too: the older whole one, never a fresh start
    shard = _shard(save / "iter_0000004")
    shard.write_bytes(shard.read_bytes()[:10])
    point = find_resume_point(save)
    assert point.iteration == 2
    shard = _shard(save / "iter_0000002")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert "none is whole" in _one_line(err)


def test_fallback_only_on_request_and_it_says_so(tmp_path):
    save = _saved(tmp_path)
    shard = _shard(save / "iter_0000004")
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert "is missing" in _one_line(err)
    point = find_resume_point(save, fallback=True)
    assert point.iteration == 2 and "falling back to iter_0000002" in point.note and "training.resume_fallback" in point.note
    assert read_tracker(save) == 4  # nothing rewritten by looking
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    loaded = load_checkpoint(point.path, model=model, load_optim=False)
    assert loaded.iteration == 2 and loaded.app_state["step"] == 2
    # no whole older checkpoint: an error even with fallback
    shard = _shard(save / "iter_0000002")
    shard.write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save, fallback=True)
    assert "no older checkpoint is whole" in _one_line(err)


def test_damaged_tracker_is_an_error_unless_falling_back(tmp_path):
    save = _saved(tmp_path)
    (save / "latest_checkpointed_iteration.txt").write_text("not-a-number\n")
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert "training.resume_fallback" in _one_line(err)
    assert find_resume_point(save, fallback=True).iteration == 4


def test_interrupted_save_without_marker_is_not_a_resume_point(tmp_path):
    save = _saved(tmp_path)
    (save / "iter_0000004" / COMPLETE_FILENAME).unlink()  # legacy layout: accepted (its final name proves it)
    assert find_resume_point(save).iteration == 4
    (save / "iter_0000004" / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        find_resume_point(save)
    assert "incomplete save" in _one_line(err)
