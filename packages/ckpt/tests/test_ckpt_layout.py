"""Tracker file, directory names, pruning and the pure helpers (sizes, shards)."""

from __future__ import annotations

import pytest

from mmfsdp.ckpt import (
    CheckpointError,
    find_checkpoint,
    iteration_dirname,
    list_iterations,
    parse_size,
    prune_checkpoints,
    read_tracker,
    resolve_checkpoint,
    write_tracker,
)
from mmfsdp.ckpt.hf import plan_shards, shard_filename
from mmfsdp.ckpt.layout import remove_stale_tmp_dirs


def _fake_checkpoint(root, name):
    path = root / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    return path


def test_iteration_dirname():
    assert iteration_dirname(100) == "iter_0000100"
    assert iteration_dirname(12345678) == "iter_12345678"
    assert iteration_dirname("release") == "release"
    for bad in (-1, "100", 1.0, True):
        with pytest.raises(ValueError):
            iteration_dirname(bad)


def test_tracker_round_trip_and_atomic_replace(tmp_path):
    write_tracker(tmp_path, 100)
    assert read_tracker(tmp_path) == 100
    write_tracker(tmp_path, "release")
    assert read_tracker(tmp_path) == "release"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_checkpointed_iteration.txt"]


def test_tracker_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_tracker(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        read_tracker(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("iter_5\n")
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release'"):
        read_tracker(tmp_path)


def test_resolve_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    write_tracker(tmp_path, 7)
    with pytest.raises(CheckpointError, match="points at 7 but .*iter_0000007 does not exist"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000007").mkdir()
    with pytest.raises(CheckpointError, match="has no .metadata"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000007" / ".metadata").write_bytes(b"x")
    assert resolve_checkpoint(tmp_path) == (tmp_path / "iter_0000007", 7)
    # an iteration or release directory can be named directly
    assert resolve_checkpoint(tmp_path / "iter_0000007") == (tmp_path / "iter_0000007", 7)
    release = _fake_checkpoint(tmp_path / "conv", "release")
    assert resolve_checkpoint(release) == (release, "release")
    odd = _fake_checkpoint(tmp_path, "weights")
    with pytest.raises(CheckpointError, match="neither iter_NNNNNNN nor release"):
        resolve_checkpoint(odd)


def test_find_checkpoint_returns_none_before_the_first_save(tmp_path):
    assert find_checkpoint(None) is None
    assert find_checkpoint(tmp_path / "not_yet") is None
    assert find_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, "iter_0000003")
    write_tracker(tmp_path, 3)
    assert find_checkpoint(tmp_path) == (tmp_path / "iter_0000003", 3)
    write_tracker(tmp_path, 4)
    with pytest.raises(CheckpointError, match="points at 4"):
        find_checkpoint(tmp_path)


def test_prune_keeps_newest_tracker_target_and_release(tmp_path):
    for iteration in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, iteration_dirname(iteration))
    _fake_checkpoint(tmp_path, "release")
    write_tracker(tmp_path, 10)  # e.g. resumed from an older checkpoint
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["iter_0000020"]
    assert list_iterations(tmp_path) == [10, 30, 40]
    assert (tmp_path / "release").is_dir()
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep_last=0)


def test_remove_stale_tmp_dirs(tmp_path):
    (tmp_path / "iter_0000005.tmp-abcd1234").mkdir()
    (tmp_path / "iter_0000003.old-abcd1234").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt.tmp-1234").write_text("3")
    keep = _fake_checkpoint(tmp_path, "iter_0000003")
    removed = remove_stale_tmp_dirs(tmp_path)
    assert len(removed) == 3
    assert [p.name for p in tmp_path.iterdir()] == [keep.name]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size("123") == 123
    for bad in ("5 parsecs", "-1GB", "0", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_shards():
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 2)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert shard_filename(0, 3) == "model-00001-of-00003.safetensors"



def test_preview_shows_the_first_keys_and_counts_the_rest():
    from mmfsdp.ckpt.errors import preview

    assert preview(["a", "b"]) == "a, b"
    assert preview([f"k{i}" for i in range(12)]) == "k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, ... (2 more)"
    assert preview(["a", "b", "c"], limit=2) == "a, b, ... (1 more)"
