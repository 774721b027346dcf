"""A packed batch gives every sample the same loss as running it alone: no attention across samples.

Three image+text samples are packed into two rows by the `pixtral` collator. The tiny
HF `Mistral3ForConditionalGeneration` (eager attention, fp32) runs the packed batch
with a 4-D block-diagonal causal mask built here from `cu_seq_lens` and the
collator's restarting `position_ids`; each sample's mean token loss must equal the
loss of that sample run on its own (rel <= 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmfsdp.data import SampleEncoder
from mmfsdp.data.families.mistral.collator import PixtralCollator
from mmfsdp.parallel.testing import assert_within


def _sample(encoder, path: str, question: str, answer: str) -> dict:
    row = {"messages": [{"role": "user", "content": f"<image>{question}"}, {"role": "assistant", "content": answer}], "images": [path]}
    s = encoder.encode_row(row)
    pixel_values, image_sizes = encoder.plugin.load_images(s["images"], [tuple(g) for g in s["image_grids"]])
    return {"input_ids": torch.tensor(s["input_ids"]), "labels": torch.tensor(s["labels"]), "pixel_values": pixel_values, "image_sizes": image_sizes}


def _block_causal_mask(cu_seq_lens: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """Additive [B, 1, S, S] mask: token i sees token j iff both lie in one segment of cu_seq_lens and j <= i."""
    segment = torch.zeros(batch_size * seq_len, dtype=torch.long)
    for k in range(len(cu_seq_lens) - 1):
        segment[int(cu_seq_lens[k]) : int(cu_seq_lens[k + 1])] = k
    segment = segment.view(batch_size, seq_len)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    allowed = same & causal
    mask = torch.zeros(batch_size, 1, seq_len, seq_len)
    return mask.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=-100)


def test_packed_loss_equals_one_by_one(tiny_processor, tiny_model, tmp_path, h):
    encoder = SampleEncoder(h.data_config(tiny_processor.name_or_path, tmp_path), tiny_processor)
    samples = [
        _sample(encoder, h.write_image(tmp_path / "a.png", 40, 24, seed=1), "What shape and colour is this?", "a red circle"),
        _sample(encoder, h.write_image(tmp_path / "b.png", 17, 64, seed=2), "What colour is this?", "blue"),
        _sample(encoder, h.write_image(tmp_path / "c.png", 64, 64, seed=3), "What shape is this?", "a green square and a yellow triangle"),
    ]
    rows = [[samples[0], samples[1]], [samples[2]]]
    batch = PixtralCollator(pad_token_id=tiny_processor.pad_token_id, pad_to_multiple_of=8, packing=True)(rows)
    batch_size, seq_len = batch["input_ids"].shape
    cu = batch["cu_seq_lens"]
    # cu_seq_lens and position_ids describe the same segments.
    starts = torch.nonzero(batch["position_ids"].flatten() == 0).flatten()
    assert torch.equal(starts.to(torch.int32), cu[:-1])

    with torch.no_grad():
        packed = tiny_model(
            input_ids=batch["input_ids"],
            attention_mask=_block_causal_mask(cu, batch_size, seq_len),
            position_ids=batch["position_ids"],
            pixel_values=batch["pixel_values"],
            image_sizes=batch["image_sizes"],
        ).logits
        offsets = [(0, 0), (0, len(samples[0]["input_ids"])), (1, 0)]
        for sample, (row, start) in zip(samples, offsets):
            n = len(sample["input_ids"])
            alone = tiny_model(input_ids=sample["input_ids"][None], pixel_values=torch.stack(sample["pixel_values"]), image_sizes=sample["image_sizes"]).logits[0]
            loss_alone = _loss(alone, sample["labels"])
            loss_packed = _loss(packed[row, start : start + n], batch["labels"][row, start : start + n])
            assert torch.equal(batch["labels"][row, start : start + n], sample["labels"])
            assert_within(abs(loss_packed - loss_alone) / abs(loss_alone), 1e-5, f"loss packed {loss_packed} vs alone {loss_alone}")
        # The check has teeth: with only the padding mask, the second sample attends to the first.
        leaky = tiny_model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            pixel_values=batch["pixel_values"],
            image_sizes=batch["image_sizes"],
        ).logits
        start, n = offsets[1][1], len(samples[1]["input_ids"])
        alone = tiny_model(input_ids=samples[1]["input_ids"][None], pixel_values=torch.stack(samples[1]["pixel_values"]), image_sizes=samples[1]["image_sizes"]).logits[0]
        assert abs(_loss(leaky[0, start : start + n], samples[1]["labels"]) - _loss(alone, samples[1]["labels"])) > 1e-4
