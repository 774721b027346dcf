"""`sample_multiple` for context parallel: every packed sample padded to the multiple; rows planned without it."""

from __future__ import annotations

import torch

from mmfsdp.data import IGNORE_INDEX, StatefulDataLoader
from mmfsdp.data.families.mistral.collator import PixtralCollator


def _text(n: int, start: int = 20) -> dict:
    ids = torch.arange(start, start + n)
    labels = ids.clone()
    labels[: n // 2] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def test_packed_samples_are_padded_to_the_sample_multiple():
    rows = [[_text(5), _text(3, 40)], [_text(9)], [_text(2), _text(2), _text(4)]]
    batch = PixtralCollator(pad_token_id=0, pad_to_multiple_of=3, packing=True, sample_multiple=4)(rows)
    batch_size, seq_len = batch["input_ids"].shape
    assert seq_len == 12  # the longest row (8 + 4 or 12) rounded to lcm(3, 4)
    cu = batch["cu_seq_lens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert lengths == [8, 4, 12, 4, 4, 4]
    assert all(length % 4 == 0 for length in lengths) and int(cu[-1]) == batch_size * seq_len
    starts = torch.nonzero(batch["position_ids"].flatten() == 0).flatten().to(torch.int32)
    assert torch.equal(starts, cu[:-1])
    assert batch["attention_mask"].sum(1).tolist() == [8, 9, 8]  # real tokens only
    # row 0: sample of 5 tokens + 3 pads, sample of 3 tokens + 1 pad, nothing after
    assert batch["attention_mask"][0].tolist() == [1] * 5 + [0] * 3 + [1] * 3 + [0]
    assert batch["input_ids"][0, 5:8].eq(0).all() and batch["labels"][0, 5:8].eq(IGNORE_INDEX).all()
    assert torch.equal(batch["input_ids"][0, 8:11], torch.arange(40, 43))
    assert torch.equal(batch["labels"][0, 8:11], _text(3, 40)["labels"])
    assert batch["position_ids"][0].tolist() == list(range(8)) + list(range(4))


def test_without_packing_the_sample_multiple_is_the_row_multiple():
    batch = PixtralCollator(pad_token_id=11, pad_to_multiple_of=2, sample_multiple=8)([_text(5), _text(10)])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(1).tolist() == [5, 10]
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, 16))


class _Lengths:
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)


def _plan(capacity: int):
    loader = StatefulDataLoader(
        _Lengths([5, 5, 5, 3]), None, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, shuffle=False,
        packing=True, capacity=capacity, drop_last=False,
    )
    return [row for (row,) in loader._epoch_plan(0)]


def test_packing_plans_rows_with_the_unpadded_lengths():
    """The plan never sees CP's padding, so every ring / Ulysses size (CP = 1 included) packs the same rows."""
    assert _plan(16) == [(0, 1, 2), (3,)]  # 15 tokens fit in 16; CP's padding (e.g. to 8 each) is added to the row
    assert _plan(12) == [(0, 1), (2, 3)]


def test_cp_padding_adds_no_loss_and_keeps_the_samples():
    """The same packed rows collated with sample_multiple 1, 4 and 8: the same real tokens, labels and trained tokens."""
    rows = [[_text(5), _text(3, 40)], [_text(9)], [_text(2), _text(2), _text(4)]]
    batches = {m: PixtralCollator(pad_token_id=0, packing=True, sample_multiple=m)(rows) for m in (1, 4, 8)}
    for m, batch in batches.items():
        real = batch["attention_mask"].bool()
        assert [batch["input_ids"][b][real[b]].tolist() for b in range(3)] == [
            torch.cat([s["input_ids"] for s in row]).tolist() for row in rows
        ], m
        assert [batch["labels"][b][real[b]].tolist() for b in range(3)] == [torch.cat([s["labels"] for s in row]).tolist() for row in rows]
        assert batch["labels"][~real].eq(IGNORE_INDEX).all()  # padding trains nothing
