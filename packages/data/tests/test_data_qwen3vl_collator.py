"""The `qwen3vl` collator and the dataset path with the `qwen2_vl` plugin; every collator's batch keys.

Batches (unpacked and packed) hold exactly the keys of the batch contract (docs/data.md, "Batches"), labels
train only assistant answers, `mm_token_type_ids` marks the image tokens, pixels are
the samples' patches concatenated in order. The cached dataset serves the same
tensors, and its cache key changes with `image_max_pixels`.
"""

from __future__ import annotations

import pytest
import torch

from mmfsdp.data import IGNORE_INDEX, Collator, SampleEncoder, build_dataloader, build_dataset, get_collator
from mmfsdp.data.families.mistral.collator import PixtralCollator
from mmfsdp.data.families.qwen3_vl.collator import Qwen3VLCollator

ROWS = [
    ("<image>What shape and colour is this?", "a red circle", [(40, 70)]),
    ("Compare these:<image><image>", "The second one is wider.", [(300, 120), (64, 64)]),
    ("Thanks! Anything else?", "No, that's all.", []),
]


def _row(user: str, answer: str, paths: list[str]) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], "images": paths}


@pytest.fixture()
def rows(tmp_path, h) -> list[dict]:
    out = []
    for i, (user, answer, sizes) in enumerate(ROWS):
        paths = [h.write_image(tmp_path / f"r{i}_{k}.png", w, hh, seed=10 * i + k) for k, (w, hh) in enumerate(sizes)]
        out.append(_row(user, answer, paths))
    return out


def _items(encoder: SampleEncoder, rows: list[dict]) -> list[dict]:
    items = []
    for row in rows:
        sample = encoder.encode_row(row)
        item = {"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"])}
        item.update(encoder.plugin.token_inputs(item["input_ids"]))
        if sample["images"]:
            item.update(encoder.plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]]))
        items.append(item)
    return items


def _check_labels(processor, batch, answers_per_row: list[list[str]]) -> None:
    """Per row, the trained tokens are the answers, each followed by `<|im_end|>`, and nothing else."""
    end = processor.token_id("<|im_end|>")
    for b, answers in enumerate(answers_per_row):
        trained = batch["labels"][b][batch["labels"][b] != IGNORE_INDEX].tolist()
        assert trained == [t for ids in processor.encode_texts(answers) for t in [*ids, end]]
    assert torch.equal(batch["labels"][batch["labels"] != IGNORE_INDEX], batch["input_ids"][batch["labels"] != IGNORE_INDEX])


@pytest.mark.parametrize("packing", [False, True])
def test_qwen3vl_batch(qwen_processor, tmp_path, h, rows, packing):
    encoder = SampleEncoder(h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}), qwen_processor)
    items = _items(encoder, rows)
    collator = Qwen3VLCollator(pad_token_id=qwen_processor.pad_token_id, pad_to_multiple_of=8, packing=packing)
    batch = collator([[items[0], items[1]], [items[2]]] if packing else items)
    assert "position_ids" not in batch
    expected = {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "labels"}
    assert set(batch) == expected | ({"cu_seq_lens", "max_length"} if packing else set())
    shape = batch["input_ids"].shape
    assert all(batch[key].shape == shape for key in ("labels", "attention_mask", "mm_token_type_ids"))

    answers = [[a for _, a, _ in ROWS[:2]], [ROWS[2][1]]] if packing else [[a] for _, a, _ in ROWS]
    _check_labels(qwen_processor, batch, answers)
    assert batch["input_ids"].shape[1] % 8 == 0
    assert batch["input_ids"][~batch["attention_mask"].bool()].eq(qwen_processor.pad_token_id).all()
    image_id = qwen_processor.token_id("<|image_pad|>")
    assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == image_id)
    assert torch.equal(batch["pixel_values"], torch.cat([i["pixel_values"] for i in items if "pixel_values" in i]))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 2], [1, 8, 18], [1, 4, 4]]
    assert int((batch["input_ids"] == image_id).sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    if packing:
        cu = batch["cu_seq_lens"]
        lengths = (cu[1:] - cu[:-1]).tolist()
        seq_len = batch["input_ids"].shape[1]
        expected_lengths = []
        for row in ([items[0], items[1]], [items[2]]):
            spans = [len(i["input_ids"]) for i in row]
            expected_lengths += spans + ([seq_len - sum(spans)] if seq_len > sum(spans) else [])
        assert lengths == expected_lengths
        assert cu[-1] == batch["input_ids"].numel() and batch["max_length"] == max(lengths)


def test_every_collator_keeps_the_batch_contract():
    for name in ("pixtral", "qwen3vl"):
        assert isinstance(get_collator(name)(pad_token_id=0), Collator)
    sample = {"input_ids": torch.arange(20, 25), "labels": torch.arange(20, 25), "pixel_values": [torch.zeros(3, 8, 8)], "image_sizes": torch.tensor([[8, 8]])}
    batch = PixtralCollator(pad_token_id=0, packing=True, pad_to_multiple_of=4)([[sample, sample]])
    tokens = {"input_ids", "attention_mask", "position_ids", "labels"}
    assert set(batch) == tokens | {"pixel_values", "image_sizes", "cu_seq_lens", "max_length"}
    assert all(batch[key].shape == (1, 12) for key in tokens)
    assert batch["labels"][0, 10:].eq(IGNORE_INDEX).all() and batch["attention_mask"][0, 10:].eq(0).all()
    assert batch["pixel_values"].shape == (2, 3, 8, 8) and batch["image_sizes"].tolist() == [[8, 8], [8, 8]]
    assert batch["cu_seq_lens"].tolist() == [0, 5, 10, 12] and batch["max_length"] == 5


def test_dataset_with_the_qwen2_vl_plugin(qwen_processor, tmp_path, h, rows):
    path = h.write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}, basic={"dataset": str(path)})
    dataset = build_dataset(cfg, qwen_processor)
    assert len(dataset) == 3 and dataset.record(1)["image_grids"] == [[1, 8, 18], [1, 4, 4]]
    reference = _items(SampleEncoder(cfg, qwen_processor), rows)
    for i in range(3):
        item = dataset[i]
        assert set(item) == set(reference[i])
        assert all(torch.equal(item[k], reference[i][k]) for k in item)

    loader = build_dataloader(dataset, h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}, basic={"dataset": str(path), "shuffle": False}, loader={"collate_param": {"model_name": "qwen3vl"}}), micro_batch_size=3, dp_rank=0, dp_size=1, seed=0)
    batch = next(loader)
    expected = {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "labels"}
    # padding-free by default: the 3 samples end to end in one row, `cu_seq_lens` marks them
    assert set(batch) == expected | {"cu_seq_lens", "max_length"} and batch["image_grid_thw"].shape == (3, 3)
    assert batch["input_ids"].shape[0] == 1 and batch["cu_seq_lens"].tolist()[-1] == batch["input_ids"].shape[1]

    fingerprint = SampleEncoder(cfg, qwen_processor).fingerprint()
    smaller = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink", "image_max_pixels": 64 * 64}, basic={"dataset": str(path)})
    assert SampleEncoder(smaller, qwen_processor).fingerprint() != fingerprint
    resized = build_dataset(smaller, qwen_processor)
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.arrow"))) == 2
    assert resized.record(1)["image_grids"] != dataset.record(1)["image_grids"]
    assert resized[1]["pixel_values"].shape[0] == sum(t * hh * w for t, hh, w in resized.record(1)["image_grids"])


def test_inspect_shows_qwen_image_blocks(qwen_dir, tmp_path, h, rows, capsys):
    import yaml

    from mmfsdp.data.cli import TRAIN_CLOSE, TRAIN_OPEN, main

    h.write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = {
        "data": {
            "dataset_param": {
                "preprocess_parameters": {"model_name_or_path": str(qwen_dir), "template": "qwen3_vl_nothink"},
                "basic_parameters": {"dataset_dir": str(tmp_path), "dataset": "d.jsonl", "cache_dir": str(tmp_path / "cache")},
            },
            "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "qwen3vl"}},
        }
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["inspect", str(tmp_path / "run.yaml"), "--index", "1"]) == 0
    out = capsys.readouterr().out
    assert "grid 1x8x18 patches -> 36 <|image_pad|> + start/end = 38 tokens" in out
    assert "<|im_start|>user\nCompare these:<image 1x8x18><image 1x4x4><|im_end|>" in out
    assert f"assistant\n{TRAIN_OPEN}The second one is wider.<|im_end|>{TRAIN_CLOSE}" in out
