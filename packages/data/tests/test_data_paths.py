"""Row media paths (`mmfsdp.data.paths.media_path`) and the all-bad error.

The rule: a row may not leave `dataset_dir` with `..` (checked lexically, before any file is
read); a symlink the user placed inside `dataset_dir` is followed wherever it points.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmfsdp.data import BAD_REASONS, BadSample, DataError, build_dataset
from mmfsdp.data.errors import BAD_REASON_ADVICE, all_rows_bad_message, top_reason
from mmfsdp.data.paths import media_path

Q = "What shape and colour is this?"


def _conv(images: list[str]) -> dict:
    user = {"role": "user", "content": "<image>" * len(images) + Q}
    return {"messages": [user, {"role": "assistant", "content": "a red circle"}], "images": images}


@pytest.fixture(scope="module")
def tree(tmp_path_factory, h) -> tuple[Path, Path]:
    """`root/data` (dataset_dir) whose `images` links to `root/shared/coco`, outside it, holding one image."""
    root = tmp_path_factory.mktemp("paths")
    h.write_image(root / "shared" / "coco" / "x.png", 24, 16)
    h.write_image(root / "outside.png", 16, 16, seed=1)
    data = root / "data"
    data.mkdir()
    (data / "images").symlink_to(root / "shared" / "coco", target_is_directory=True)
    return root, data


def _config(h, tiny_dir, tmp_path, data: Path, dataset: Path, **basic):
    basic = {"dataset": str(dataset), "dataset_dir": str(data), "shuffle": False, **basic}
    return h.data_config(tiny_dir, tmp_path, basic=basic, preprocess={"cutoff_len": 64})


@pytest.mark.parametrize(
    ("path", "inside"),
    [
        ("x.png", True),
        ("./images/x.png", True),
        ("images/../x.png", True),  # folded lexically: dataset_dir/x.png, not the parent of the symlink's target
        ("a/b/../../x.png", True),
        ("../x.png", False),
        ("images/../../x.png", False),
        ("a/../../data/x.png", True),  # leaves and comes back: the normalised path is inside
        ("../../../../../../../../../../etc/passwd", False),
    ],
)
def test_media_path_is_lexical(tmp_path, path, inside):
    data = tmp_path / "data"
    if inside:
        assert media_path(path, data, allow_outside=False) == os.path.normpath(data / path)
    else:
        with pytest.raises(BadSample) as err:
            media_path(path, data, allow_outside=False)
        assert err.value.reason == "image_outside_dataset_dir" and f"{path} resolves to" in err.value.detail
        assert media_path(path, data, allow_outside=True) == os.path.normpath(data / path)


def test_media_path_keeps_absolute_paths_and_takes_a_reason(tmp_path):
    assert media_path("/mnt/coco/x.png", tmp_path, allow_outside=False) == "/mnt/coco/x.png"
    assert media_path("~/x.png", tmp_path, allow_outside=False) == str(Path("~/x.png").expanduser())
    with pytest.raises(BadSample) as err:
        media_path("../v.mp4", tmp_path, allow_outside=False, reason="missing_image")  # videos: a reason of their own
    assert err.value.reason == "missing_image"


def test_a_symlinked_image_tree_inside_dataset_dir_is_followed_and_loads(tree, tiny_dir, tiny_processor, tmp_path, h):
    root, data = tree
    path = h.write_jsonl(tmp_path / "sym.jsonl", [_conv(["images/x.png"]), _conv(["images/x.png", "images/x.png"])])
    dataset = build_dataset(_config(h, tiny_dir, tmp_path, data, path), tiny_processor)
    assert len(dataset) == 2 and dataset.bad_row_counts == {}
    assert Path(dataset.record(0)["images"][0]).resolve() == (root / "shared" / "coco" / "x.png").resolve()
    item = dataset[1]
    assert [tuple(p.shape) for p in item["pixel_values"]] == [(3, 16, 24), (3, 16, 24)]  # really decoded
    assert item["image_sizes"].tolist() == [[16, 24], [16, 24]]


def test_a_dotdot_escape_is_refused_counted_and_never_opened(tree, tiny_dir, tiny_processor, tmp_path, h, monkeypatch):
    _, data = tree
    rows = [_conv([p]) for p in ("images/x.png", "../outside.png", "images/../../outside.png", "images/x.png")]
    path = h.write_jsonl(tmp_path / "escape.jsonl", rows)
    seen: list[str] = []
    real_is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: seen.append(str(self)) or real_is_file(self))
    dataset = build_dataset(_config(h, tiny_dir, tmp_path, data, path), tiny_processor)
    assert dataset.bad_row_counts == {"image_outside_dataset_dir": 2}
    assert [dataset.location(i)[1] for i in range(len(dataset))] == [0, 3]
    assert not [p for p in seen if p.endswith("outside.png")]  # the path is checked before any file is touched


def test_strict_names_file_row_and_reason(tree, tiny_dir, tiny_processor, tmp_path, h):
    _, data = tree
    path = h.write_jsonl(tmp_path / "strict.jsonl", [_conv(["images/x.png"]), _conv(["images/../../outside.png"])])
    with pytest.raises(DataError) as err:
        build_dataset(_config(h, tiny_dir, tmp_path, data, path, strict=True), tiny_processor)
    message = str(err.value)
    assert message.startswith(f"{path} row 1: image_outside_dataset_dir: images/../../outside.png resolves to ")
    assert "\n" not in message


def test_every_row_bad_names_the_top_reason_an_example_and_the_fix(tree, tiny_dir, tiny_processor, tmp_path, h):
    _, data = tree
    rows = [_conv(["images/x.png", "nope.png"]), {"messages": []}, _conv(["gone.png"]), _conv(["missing/y.png"])]
    path = h.write_jsonl(tmp_path / "allbad.jsonl", rows)
    with pytest.raises(DataError) as err:
        build_dataset(_config(h, tiny_dir, tmp_path, data, path), tiny_processor)
    message = str(err.value)
    assert message.startswith("every one of the 4 rows of allbad.jsonl is bad (empty_conversation=1, missing_image=3)")
    assert f"Top reason: missing_image (3 of 4 rows), e.g. {path} row 0: {data / 'nope.png'} does not exist" in message
    assert message.endswith(f"Fix: {BAD_REASON_ADVICE['missing_image']}") and "basic_parameters.dataset_dir" in message
    assert "\n" not in message


def test_every_reason_has_advice_and_the_message_uses_it():
    assert set(BAD_REASON_ADVICE) == set(BAD_REASONS) and all(BAD_REASON_ADVICE.values())
    for reason in BAD_REASONS:
        counts = {reason: 3, "too_long": 1} if reason != "too_long" else {reason: 3}
        message = all_rows_bad_message(5, "f.jsonl", counts, ("f.jsonl", 2, "the detail"))
        expected = f"Top reason: {reason} (3 of 5 rows), e.g. f.jsonl row 2: the detail. "
        assert message.endswith(expected + f"Fix: {BAD_REASON_ADVICE[reason]}")
    assert top_reason({"too_long": 2, "missing_image": 2}) == "missing_image"  # a tie: the earlier-checked reason
    assert top_reason({}) is None
    assert "no rows" in all_rows_bad_message(0, "f.jsonl", {}, None)
