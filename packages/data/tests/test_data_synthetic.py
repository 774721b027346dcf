"""Synthetic coloured shapes, the tiny offline processor and the `synthetic_shapes_pairs` dataset type."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmfsdp.config import ConfigError
from mmfsdp.data import DataError, build_dataset, prepare_dataset

from mmfsdp.data.synthetic import (
    COLOURS,
    PROMPT,
    TEXT_ONLY_OBJECTS,
    VARLEN_IMAGE_SIZES,
    make_shapes_dataset,
    make_varlen_dataset,
)
from mmfsdp.data.families.mistral.synthetic import tiny_processor_ids, write_tiny_processor


def _make(out: str) -> None:
    make_shapes_dataset(out, num_train=24, num_eval=6, image_size=32, seed=7)


def test_shapes_dataset_layout_and_labels(tmp_path):
    meta = make_shapes_dataset(tmp_path / "s", num_train=24, num_eval=6, image_size=32, seed=7)
    assert meta["chance"] == 1 / 12 and meta["num_classes"] == 12
    rows = [json.loads(line) for line in (tmp_path / "s" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and len((tmp_path / "s" / "eval.jsonl").read_text().splitlines()) == 6
    answers = [r["messages"][1]["content"] for r in rows]
    assert len(set(answers)) == 12 and all(a.count(" ") == 2 for a in answers)
    assert all(r["messages"][0] == {"role": "user", "content": PROMPT} for r in rows)
    refs = np.array(list(COLOURS.values()), dtype=np.float32)
    for row, answer in zip(rows, answers):
        pixels = np.asarray(Image.open(tmp_path / "s" / row["images"][0]).convert("RGB"), dtype=np.float32).reshape(-1, 3)
        assert pixels.shape == (32 * 32, 3)
        # The answer's colour is the reference colour most pixels are close to: the shape is really drawn.
        close = (np.linalg.norm(pixels[:, None, :] - refs[None], axis=-1) < 60).sum(0)
        assert list(COLOURS)[int(close.argmax())] == answer.split()[1]


def test_concurrent_writers_produce_one_deterministic_dataset(tmp_path):
    ctx = multiprocessing.get_context("fork")
    target = str(tmp_path / "shared")
    procs = [ctx.Process(target=_make, args=(target,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    _make(str(tmp_path / "serial"))
    for name in ("train.jsonl", "eval.jsonl", "meta.json", "images/train_000003.png"):
        assert (tmp_path / "shared" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serial", "shared"]  # no temporary directories left


def test_tiny_processor_loads_offline(tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer

    ids = write_tiny_processor(tmp_path / "tiny", image_size=48, patch_size=4, spatial_merge_size=2)
    assert ids == tiny_processor_ids()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tiny"), local_files_only=True)
    assert len(tokenizer) == ids["vocab_size"]
    assert tokenizer.convert_tokens_to_ids("[IMG]") == ids["image_token_index"] and tokenizer.pad_token_id == ids["pad_token_id"]
    assert tokenizer("a red circle", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(w) for w in ("a", "red", "circle")]
    assert "<unk>" not in tokenizer.convert_ids_to_tokens(tokenizer("What shape and colour is this?", add_special_tokens=False)["input_ids"])
    image_processor = AutoImageProcessor.from_pretrained(str(tmp_path / "tiny"), local_files_only=True)
    assert image_processor.size["longest_edge"] == 48
    assert json.loads(Path(tmp_path / "tiny" / "processor_config.json").read_text())["spatial_merge_size"] == 2


def test_prepare_dataset_from_several_ranks_at_once(tmp_path):
    from mmfsdp.config import build
    from mmfsdp.data import DataConfig, build_dataset, build_processor, prepare_dataset

    raw = {
        "dataset_param": {
            "dataset_type": "synthetic_shapes",
            "preprocess_parameters": {"model_name_or_path": str(tmp_path / "tiny"), "template": "mistral"},
            "basic_parameters": {"dataset_dir": str(tmp_path / "shapes"), "cache_dir": str(tmp_path / "cache")},
            "synthetic": {"num_train": 12, "num_eval": 4, "image_size": 32, "patch_size": 4},
        }
    }
    cfg = build(DataConfig, raw, "data")
    # fresh interpreters (spawn), not forks of this test process: a fork inherits its other threads' locks (Arrow's
    # pools among them) and once hung in `datasets`' writer, every child waiting for the whole timeout
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=prepare_dataset, args=(cfg,)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(180)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(build_dataset(cfg, build_processor(cfg), "train")) == 12
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_varlen_dataset_varies_and_is_deterministic(tmp_path):
    make_varlen_dataset(tmp_path / "a", num_train=48, num_eval=4, seed=3)
    make_varlen_dataset(tmp_path / "b", num_train=48, num_eval=4, seed=3)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert {len(r["images"]) for r in rows} == {0, 1, 2}
    assert {len(r["messages"]) // 2 for r in rows} == {1, 2, 3}
    words = [len(m["content"].split()) for r in rows for m in r["messages"][1::2]]
    assert min(words) == 1 and max(words) >= 12 and max(words) <= 15
    sizes = {Image.open(tmp_path / "a" / p).size for r in rows for p in r["images"]}
    assert len(sizes) >= 4 and sizes <= set(VARLEN_IMAGE_SIZES)
    for r in rows:  # every placeholder in a user turn, one per image
        assert sum(m["content"].count("<image>") for m in r["messages"][0::2]) == len(r["images"])
        assert all("<image>" not in m["content"] for m in r["messages"][1::2])
    make_varlen_dataset(tmp_path / "c", num_train=16, num_eval=0, seed=3, min_images=1)
    assert all(json.loads(line)["images"] for line in (tmp_path / "c" / "train.jsonl").read_text().splitlines())


def test_varlen_dataset_tokenizes_without_unknown_words(tiny_processor, tmp_path, h):
    from mmfsdp.data import build_dataset

    make_varlen_dataset(tmp_path / "v", num_train=16, num_eval=0, seed=1)
    basic = {"dataset": str(tmp_path / "v" / "train.jsonl"), "dataset_dir": str(tmp_path / "v")}
    cfg = h.data_config(tiny_processor.name_or_path, tmp_path, basic=basic)
    dataset = build_dataset(cfg, tiny_processor, split="train")
    assert len(dataset) == 16 and len(set(dataset.lengths)) >= 10
    unk = tiny_processor_ids()["unk_token_id"]
    assert all(unk not in dataset[i]["input_ids"].tolist() for i in range(len(dataset)))


def test_text_only_share_of_the_shapes_data(tmp_path, tiny_processor, h):
    from mmfsdp.data import build_dataset

    meta = make_shapes_dataset(tmp_path / "s", num_train=40, num_eval=6, image_size=32, seed=7, text_only_share=0.3)
    assert meta["text_only_share"] == 0.3 and meta["num_text_only_train"] == 12 and meta["chance"] == 1 / 12
    rows = [json.loads(line) for line in (tmp_path / "s" / "train.jsonl").read_text().splitlines()]
    text_rows = [r for r in rows if not r["images"]]
    assert len(rows) == 40 and len(text_rows) == 12
    for r in text_rows:  # the text task: a fixed object -> colour lookup, worded unlike the image question
        question, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        assert "<image>" not in question and question != PROMPT
        assert TEXT_ONLY_OBJECTS[question.removeprefix("What colour is ").removesuffix("?")] == answer
    assert all(r["messages"][0]["content"] == PROMPT for r in rows if r["images"])
    eval_rows = (tmp_path / "s" / "eval.jsonl").read_text().splitlines()
    assert all(json.loads(line)["images"] for line in eval_rows)  # eval: the image task only
    basic = {"dataset": str(tmp_path / "s" / "train.jsonl"), "dataset_dir": str(tmp_path / "s")}
    dataset = build_dataset(h.data_config(tiny_processor.name_or_path, tmp_path, basic=basic), tiny_processor)
    unk = tiny_processor_ids()["unk_token_id"]
    assert len(dataset) == 40 and all(unk not in dataset[i]["input_ids"].tolist() for i in range(len(dataset)))
    # Share 0 writes exactly the image-only data of before; a directory generated with another share is never reused.
    make_shapes_dataset(tmp_path / "zero", num_train=24, num_eval=6, image_size=32, seed=7, text_only_share=0.0)
    make_shapes_dataset(tmp_path / "plain", num_train=24, num_eval=6, image_size=32, seed=7)
    assert (tmp_path / "zero" / "train.jsonl").read_bytes() == (tmp_path / "plain" / "train.jsonl").read_bytes()
    with pytest.raises(DataError, match=r"other settings \(text_only_share: 0\.3 there, 0\.0 asked\); delete"):
        make_shapes_dataset(tmp_path / "s", num_train=40, num_eval=6, image_size=32, seed=7)
    legacy = json.loads((tmp_path / "plain" / "meta.json").read_text())
    del legacy["text_only_share"]  # meta.json written before the setting existed: its data had no text-only rows
    (tmp_path / "plain" / "meta.json").write_text(json.dumps(legacy))
    assert make_shapes_dataset(tmp_path / "plain", num_train=24, num_eval=6, image_size=32, seed=7)["num_train"] == 24
    with pytest.raises(DataError, match="text_only_share: 0.0 there, 0.5 asked"):
        make_shapes_dataset(tmp_path / "plain", num_train=24, num_eval=6, image_size=32, seed=7, text_only_share=0.5)
    with pytest.raises(ValueError, match=r"text_only_share must be in \[0, 1\)"):
        make_shapes_dataset(tmp_path / "bad", num_train=4, num_eval=1, image_size=32, seed=7, text_only_share=1.0)


def test_varlen_text_only_share_is_exact_and_deterministic(tmp_path):
    make_varlen_dataset(tmp_path / "m", num_train=30, num_eval=5, seed=3, min_images=1, text_only_share=0.4)
    rows = [json.loads(line) for line in (tmp_path / "m" / "train.jsonl").read_text().splitlines()]
    assert sum(not r["images"] for r in rows) == 12  # exactly 40 %: min_images=1 holds for the others
    assert all(not any("<image>" in m["content"] for m in r["messages"]) for r in rows if not r["images"])
    assert sum(not json.loads(line)["images"] for line in (tmp_path / "m" / "eval.jsonl").read_text().splitlines()) == 2
    make_varlen_dataset(tmp_path / "n", num_train=30, num_eval=5, seed=3, min_images=1, text_only_share=0.4)
    assert (tmp_path / "m" / "train.jsonl").read_bytes() == (tmp_path / "n" / "train.jsonl").read_bytes()


def test_a_tiny_processor_from_before_the_text_words_is_an_error_not_reused(tmp_path):
    write_tiny_processor(tmp_path / "tiny", image_size=32, patch_size=4, spatial_merge_size=2)
    raw = json.loads((tmp_path / "tiny" / "tokenizer.json").read_text())
    del raw["model"]["vocab"]["banana"]
    (tmp_path / "tiny" / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"tokenizer\.json lacks the words \['banana'\]"):
        write_tiny_processor(tmp_path / "tiny", image_size=32, patch_size=4, spatial_merge_size=2)


def test_synthetic_shapes_pairs(tiny_processor, tmp_path, h):
    syn = {"num_train": 20, "num_eval": 4, "image_size": 32, "text_only_share": 0.25}
    raw = {
        "dataset_param": {
            "dataset_type": "synthetic_shapes_pairs",
            "synthetic": syn,
            "attr": {"ranking": True},
            "preprocess_parameters": {"model_name_or_path": tiny_processor.name_or_path, "template": "mistral"},
            "basic_parameters": {"dataset_dir": str(tmp_path / "shapes"), "cache_dir": str(tmp_path / "cache")},
        },
        "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "pixtral"}},
    }
    from mmfsdp.config import build
    from mmfsdp.data import DataConfig

    cfg = build(DataConfig, raw, "data")
    prepare_dataset(cfg)
    rows = [json.loads(line) for line in (tmp_path / "shapes" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and sum(not r["images"] for r in rows) == 5
    for row in rows:
        chosen, rejected = row["messages"][-1]["content"], row["rejected"]
        if row["images"]:
            (_, c_colour, c_shape), (_, r_colour, r_shape) = chosen.split(), rejected.split()
            assert c_shape == r_shape and c_colour != r_colour and r_colour in COLOURS
        else:
            assert chosen != rejected and rejected in COLOURS
    dataset = build_dataset(cfg, tiny_processor)
    assert dataset.is_preference and len(dataset) == 20 and not dataset.bad_row_counts
    raw["dataset_param"]["attr"] = {"ranking": False}
    with pytest.raises(ConfigError, match="attr.ranking"):
        prepare_dataset(build(DataConfig, raw, "data"))
