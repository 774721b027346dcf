"""Hostile rows are bad rows, not crashes: JSON that breaks parsers, text that breaks Arrow, paths that leave dataset_dir.

Each is skipped and counted under its own reason (or, with strict, named by file, row and reason in one line),
and a refused image path is never opened.
"""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
from PIL import Image

from mmfsdp.data import DataError, build_dataset

Q = "What shape and colour is this?"


def _conv(user: str = f"<image>{Q}", images: list[str] | None = None, **extra) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "a red circle"}], "images": images or [], **extra}


def _line(row: dict) -> bytes:
    return json.dumps(row).encode()


@pytest.fixture()
def hostile(tmp_path: Path, h):
    """`tmp/data` (dataset_dir) with a good image; `tmp/outside.png` next to it; the killer rows as bytes."""
    data = tmp_path / "data"
    h.write_image(data / "small.png", 16, 16)
    outside = Path(h.write_image(tmp_path / "outside.png", 16, 16, seed=1))
    absolute = Path(h.write_image(tmp_path / "elsewhere" / "absolute.png", 16, 16, seed=2))
    to_root = "../" * len(data.resolve().parts)  # enough `..` to reach / from dataset_dir
    killers = {
        "nested_too_deep": b"[" * 100_000 + b"]" * 100_000,
        "number_too_long": _line(_conv(images=["small.png"], n=0)).replace(b'"n": 0', b'"n": ' + b"7" * 5000),
        "lone_surrogate": _line(_conv(f"<image>{Q} \ud800", images=["small.png"])),  # json.dumps writes the \ud800 escape
        "not_utf8": _line(_conv(images=["small.png"])).replace(b"colour", b"colo\xffur"),
    }
    paths = {
        "../../../../etc/passwd": "image_outside_dataset_dir",
        f"{to_root}etc/passwd": "image_outside_dataset_dir",
        "../outside.png": "image_outside_dataset_dir",
        str(absolute): None,  # absolute: allowed, counted
    }
    return data, outside, absolute, killers, paths


def _config(h, tiny_dir, tmp_path, dataset: Path, **basic):
    cfg = h.data_config(tiny_dir, tmp_path, basic={"dataset": str(dataset), "shuffle": False, **basic}, preprocess={"cutoff_len": 64})
    cfg.dataset_param.basic_parameters.dataset_dir = str(dataset.parent)
    return cfg


def _write_jsonl(data: Path, killers: dict[str, bytes], paths: dict[str, str | None]) -> Path:
    good = _line(_conv(images=["small.png"]))
    lines = [good, *killers.values(), *(_line(_conv(images=[p])) for p in paths), good]
    path = data / "hostile.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture()
def opened(monkeypatch) -> list[str]:
    """Every path given to PIL's `Image.open` or to `open` while the test runs."""
    seen: list[str] = []
    real_image_open, real_open = Image.open, builtins.open

    def image_open(fp, *args, **kwargs):
        seen.append(str(fp))
        return real_image_open(fp, *args, **kwargs)

    def any_open(file, *args, **kwargs):
        seen.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(Image, "open", image_open)
    monkeypatch.setattr(builtins, "open", any_open)
    return seen


def test_hostile_jsonl_rows_are_counted_by_reason_and_refused_files_never_opened(hostile, tiny_dir, tiny_processor, tmp_path, h, opened):
    data, _, absolute, killers, paths = hostile
    path = _write_jsonl(data, killers, paths)
    dataset = build_dataset(_config(h, tiny_dir, tmp_path, path), tiny_processor)
    assert dataset.num_rows == 10
    assert dataset.bad_row_counts == {"not_utf8": 1, "nested_too_deep": 1, "number_too_long": 1, "lone_surrogate": 1, "image_outside_dataset_dir": 3}
    assert [dataset.location(i)[1] for i in range(len(dataset))] == [0, 8, 9]  # the good rows and the absolute path
    assert dataset.absolute_image_rows == 1
    assert dataset.record(1)["images"] == [str(absolute)]
    assert not [p for p in opened if "passwd" in p or p.endswith("outside.png")]  # refused: never opened
    assert any(p.endswith("small.png") for p in opened)  # the spy does see image reads


def test_a_json_list_with_the_same_rows_gives_the_same_counts(hostile, tiny_dir, tiny_processor, tmp_path, h):
    data, _, _, killers, paths = hostile
    good = _line(_conv(images=["small.png"]))
    items = [good, *killers.values(), *(_line(_conv(images=[p])) for p in paths), b'{"text": "a, [b] {c}"}']
    path = data / "hostile.json"
    path.write_bytes(b"[\n" + b",\n".join(items) + b"\n]\n")
    dataset = build_dataset(_config(h, tiny_dir, tmp_path, path), tiny_processor)
    assert dataset.num_rows == 10
    assert dataset.bad_row_counts == {
        "not_utf8": 1, "nested_too_deep": 1, "number_too_long": 1, "lone_surrogate": 1,
        "empty_conversation": 1, "image_outside_dataset_dir": 3,
    }
    assert [dataset.location(i)[1] for i in range(len(dataset))] == [0, 8]


@pytest.mark.parametrize(
    ("reason", "row_text"),
    [
        ("nested_too_deep", "line 2: lists/objects nest 100000 deep"),
        ("number_too_long", "line 2: Exceeds the limit (4300 digits)"),
        ("lone_surrogate", "line 2: a string holds the lone surrogate U+D800"),
        ("not_utf8", "line 2: byte"),
    ],
)
def test_strict_names_file_row_and_reason_in_one_line(hostile, tiny_dir, tiny_processor, tmp_path, h, reason, row_text):
    data, _, _, killers, _ = hostile
    path = data / f"{reason}.jsonl"
    path.write_bytes(_line(_conv(images=["small.png"])) + b"\n" + killers[reason] + b"\n")
    with pytest.raises(DataError) as err:
        build_dataset(_config(h, tiny_dir, tmp_path, path, strict=True), tiny_processor)
    message = str(err.value)
    assert message.startswith(f"{path} row 1: {reason}: {row_text}") and "\n" not in message


def test_strict_names_a_path_that_leaves_dataset_dir(hostile, tiny_dir, tiny_processor, tmp_path, h, opened):
    data, *_ = hostile
    path = h.write_jsonl(data / "traversal.jsonl", [_conv(images=["small.png"]), _conv(images=["../../../../etc/passwd"])])
    with pytest.raises(DataError, match=r"traversal\.jsonl row 1: image_outside_dataset_dir: \.\./\.\./\.\./\.\./etc/passwd resolves to .*allow_paths_outside_dataset_dir: true"):
        build_dataset(_config(h, tiny_dir, tmp_path, path, strict=True), tiny_processor)
    assert not [p for p in opened if "passwd" in p]


def test_the_allow_key_accepts_a_relative_path_outside_dataset_dir(hostile, tiny_dir, tiny_processor, tmp_path, h):
    data, outside, *_ = hostile
    path = h.write_jsonl(data / "allowed.jsonl", [_conv(images=["small.png"]), _conv(images=["../outside.png"])])
    dataset = build_dataset(_config(h, tiny_dir, tmp_path, path, allow_paths_outside_dataset_dir=True), tiny_processor)
    assert len(dataset) == 2 and dataset.bad_row_counts == {}
    assert Path(dataset.record(1)["images"][0]).resolve() == outside.resolve()
    assert dataset[1]["pixel_values"][0].shape[0] == 3  # really decoded and trained on


def test_a_json_file_that_is_not_a_list_is_one_line(tiny_dir, tiny_processor, tmp_path, h):
    for name, text, words in (("obj.json", b'{"messages": []}', "must hold a JSON list"), ("cut.json", b'[{"messages": [', "brackets do not balance")):
        path = tmp_path / name
        path.write_bytes(text)
        with pytest.raises(DataError, match=words) as err:
            build_dataset(_config(h, tiny_dir, tmp_path, path), tiny_processor)
        assert "\n" not in str(err.value)
