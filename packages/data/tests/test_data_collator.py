"""The pixtral collator: padding, positions, pad multiples, packing boundaries, batched pixels."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmfsdp.config import ConfigError
from mmfsdp.data import IGNORE_INDEX, SampleEncoder, get_collator
from mmfsdp.data.families.mistral.collator import PixtralCollator


def _text(n: int, start: int = 20) -> dict:
    ids = torch.arange(start, start + n)
    labels = ids.clone()
    labels[: n // 2] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def test_padding_positions_and_multiple():
    batch = PixtralCollator(pad_token_id=11, pad_to_multiple_of=8)([_text(5), _text(10)])
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert batch["input_ids"].shape == (2, 16) and all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"][0, 5:].eq(11).all() and batch["labels"][0, 5:].eq(IGNORE_INDEX).all()
    assert batch["attention_mask"].sum(1).tolist() == [5, 10]
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, 16))
    assert torch.equal(batch["labels"][1, :10], _text(10)["labels"])


@pytest.mark.parametrize("multiple", [1, 2 * 2 * 2, 6])
def test_packing_segments_agree_with_positions(multiple):
    rows = [[_text(5), _text(3, 40)], [_text(9)], [_text(2), _text(2), _text(4)]]
    batch = PixtralCollator(pad_token_id=0, pad_to_multiple_of=multiple, packing=True)(rows)
    batch_size, seq_len = batch["input_ids"].shape
    assert seq_len % multiple == 0 and seq_len >= 9
    cu = batch["cu_seq_lens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == batch_size * seq_len
    starts = torch.nonzero(batch["position_ids"].flatten() == 0).flatten().to(torch.int32)
    assert torch.equal(starts, cu[:-1])
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert batch["max_length"] == max(lengths)
    expected = []
    for row in ([5, 3], [9], [2, 2, 4]):
        expected += row + ([seq_len - sum(row)] if seq_len > sum(row) else [])
    assert lengths == expected
    assert batch["attention_mask"].sum(1).tolist() == [8, 9, 8]
    assert torch.equal(batch["input_ids"][0, 5:8], torch.arange(40, 43))


def test_rows_of_several_samples_need_packing():
    with pytest.raises(AssertionError):
        PixtralCollator(pad_token_id=0)([[_text(2), _text(3)]])


def test_pixel_values_equal_one_image_processor_call(tiny_processor, tmp_path, h):
    encoder = SampleEncoder(h.data_config(tiny_processor.name_or_path, tmp_path), tiny_processor)
    sizes = [[(40, 24), (7, 50)], [], [(64, 64)]]
    items, all_paths = [], []
    for i, row_sizes in enumerate(sizes):
        paths = [h.write_image(tmp_path / f"c{i}_{k}.png", w, hh, seed=10 * i + k) for k, (w, hh) in enumerate(row_sizes)]
        all_paths += paths
        sample = encoder.encode_row({"messages": [{"role": "user", "content": "<image>" * len(paths) + "What shape is this?"}, {"role": "assistant", "content": "a square"}], "images": paths})
        item = {"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"])}
        if paths:
            item["pixel_values"], item["image_sizes"] = encoder.plugin.load_images(sample["images"], [tuple(g) for g in sample["image_grids"]])
        items.append(item)
    batch = PixtralCollator(pad_token_id=tiny_processor.pad_token_id)(items)
    reference = tiny_processor.image_processor([Image.open(p) for p in all_paths], patch_size=encoder.plugin.cell, return_tensors="pt")
    assert torch.equal(batch["pixel_values"], reference["pixel_values"])
    assert torch.equal(batch["image_sizes"], torch.as_tensor(reference["image_sizes"]).long())
    assert batch["image_sizes"].dtype == torch.long


def test_unknown_collator_is_a_config_error():
    with pytest.raises(ConfigError, match="collate_param.model_name.*registered: pixtral"):
        get_collator("qwen2vl")
