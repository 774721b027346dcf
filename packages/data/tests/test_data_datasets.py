"""Dataset files: mllm and sharegpt layouts, dataset_dir resolution, max_samples, several files, the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmfsdp.config import ConfigError
from mmfsdp.data import SampleEncoder, build_dataset, dataset_files, prepare_dataset

Q = "<image>What shape and colour is this?"


def _mllm(answer: str, image: str) -> dict:
    return {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": answer}], "images": [image]}


def _sharegpt(answer: str, image: str) -> dict:
    return {"id": "x", "image": image, "conversations": [{"from": "human", "value": Q}, {"from": "gpt", "value": answer}]}


SHAREGPT_ATTR = {"messages": "conversations", "images": "image", "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}


def test_sharegpt_through_attr_equals_mllm(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "imgs" / "a.png", 30, 20)
    mllm = h.write_jsonl(tmp_path / "mllm.jsonl", [_mllm("a red circle", "imgs/a.png")])
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([_sharegpt("a red circle", "imgs/a.png")]))  # a JSON list, as LLaVA ships it
    a = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": str(mllm)}), tiny_processor)
    b = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": str(sharegpt)}, attr=SHAREGPT_ATTR), tiny_processor)
    assert a.record(0)["input_ids"] == b.record(0)["input_ids"]
    assert a.record(0)["images"] == [str((tmp_path / "imgs" / "a.png").resolve())]


def test_system_column_and_system_message(tiny_dir, tiny_processor, tmp_path, h):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], "sys": "Be brief."}
    cfg = h.data_config(tiny_dir, tmp_path, attr={"system": "sys"})
    from_column = SampleEncoder(cfg, tiny_processor).encode_row(row)
    as_message = {"messages": [{"role": "system", "content": "Be brief."}, *row["messages"]]}
    from_message = SampleEncoder(h.data_config(tiny_dir, tmp_path), tiny_processor).encode_row(as_message)
    assert from_column["input_ids"] == from_message["input_ids"]
    assert tiny_processor.token_id("[SYSTEM_PROMPT]") in from_column["input_ids"]


def test_comma_list_max_samples_and_dataset_dir_lookup(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "a.png", 16, 16)
    h.write_jsonl(tmp_path / "one.jsonl", [_mllm(f"a red {s}", "a.png") for s in ("circle", "square", "triangle")])
    h.write_jsonl(tmp_path / "two.jsonl", [_mllm("a blue circle", "a.png")] * 5)
    cfg = h.data_config(tiny_dir, tmp_path, basic={"dataset": "one.jsonl, two.jsonl", "max_samples": 2})
    assert [p.name for p in dataset_files(cfg)] == ["one.jsonl", "two.jsonl"]
    dataset = build_dataset(cfg, tiny_processor)
    assert len(dataset) == 4
    assert [dataset.location(i) for i in range(4)] == [(str(tmp_path / "one.jsonl"), 0), (str(tmp_path / "one.jsonl"), 1), (str(tmp_path / "two.jsonl"), 0), (str(tmp_path / "two.jsonl"), 1)]


def test_missing_files_and_eval_are_config_errors(tiny_dir, tmp_path, h):
    with pytest.raises(ConfigError, match=r"data\.dataset_param\.basic_parameters\.dataset: 'nope\.jsonl' is not a file"):
        dataset_files(h.data_config(tiny_dir, tmp_path, basic={"dataset": "nope.jsonl"}))
    with pytest.raises(ConfigError, match=r"basic_parameters\.eval_dataset: is not set"):
        dataset_files(h.data_config(tiny_dir, tmp_path, basic={"dataset": "x.jsonl"}), "eval")
    with pytest.raises(ConfigError, match=r"basic_parameters\.dataset: is not set"):
        dataset_files(h.data_config(tiny_dir, tmp_path))


def _arrow_files(cache: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in (cache / "tokenized").glob("*.arrow")}


def test_tokenized_cache_is_reused_and_invalidated(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "a.png", 16, 16)
    path = h.write_jsonl(tmp_path / "d.jsonl", [_mllm("a red circle", "a.png")] * 3)
    cfg = h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path)})
    prepare_dataset(cfg)
    first = build_dataset(cfg, tiny_processor)
    files = _arrow_files(tmp_path / "cache")
    assert len(files) == 1
    build_dataset(cfg, tiny_processor)
    assert _arrow_files(tmp_path / "cache") == files  # reused, not rewritten
    changed = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path)}, preprocess={"train_on_prompt": True}), tiny_processor)
    assert len(_arrow_files(tmp_path / "cache")) == 2
    assert changed.record(0)["labels"] != first.record(0)["labels"]
    h.write_jsonl(path, [_mllm("a green square", "a.png")] * 2)
    assert len(build_dataset(cfg, tiny_processor)) == 2


def test_items_decode_images_only_when_read(tiny_dir, tiny_processor, tmp_path, h, monkeypatch):
    h.write_image(tmp_path / "a.png", 16, 16)
    path = h.write_jsonl(tmp_path / "d.jsonl", [_mllm("a red circle", "a.png")] * 2)
    dataset = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path)}), tiny_processor)
    calls = []
    original = dataset.encoder.plugin.load_images
    monkeypatch.setattr(dataset.encoder.plugin, "load_images", lambda *a: calls.append(1) or original(*a))
    assert dataset.lengths.tolist() == [len(dataset.record(0)["input_ids"])] * 2 and not calls
    item = dataset[1]
    assert calls == [1] and item["pixel_values"][0].shape == (3, 16, 16)


def test_num_proc_gives_the_same_samples(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "a.png", 16, 24)
    rows = [_mllm(f"a red {s}", "a.png") for s in ("circle", "square", "triangle")] * 3 + [{"messages": []}]
    path = h.write_jsonl(tmp_path / "d.jsonl", rows)
    one = build_dataset(h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path)}), tiny_processor)
    two = build_dataset(h.data_config(tiny_dir, tmp_path / "other", basic={"dataset": str(path), "dataset_dir": str(tmp_path), "num_proc": 2}), tiny_processor)
    assert len(one) == len(two) == 9 and one.bad_row_counts == two.bad_row_counts == {"empty_conversation": 1}
    assert all(one.record(i) == two.record(i) for i in range(9))
