"""Collators: samples -> one padded batch dict, registry keyed by `collate_param.model_name`.

Every collator implements `Collator` and declares its batch in `batch_schema`: for
each key it may return, a `KeySpec` saying what the key is —

- `"input"`: a model input, passed to the model's forward as it is (nothing
  generic lists a family's input names; the trainer reads them from the schema);
- `"labels"`: the targets (`-100` = not trained), for the loss, never the model;
- `"boundary"`: sample boundaries (`cu_seq_lens`, `max_length`), for varlen attention
  and context parallel —

and how it packs and splits: `seq_dim` is its token dimension (what context parallel
splits, what padding extends, filled with `pad_value`); `None` = not per token
(pixels, grids, boundaries), kept whole. Keys absent from a batch (no image, no
packing) are simply missing. VeOmni's `DataCollateInfo` is the model.

A collator receives *rows*, each a list of samples (one sample per row without
packing, several with packing). Per row the samples' tokens are concatenated; the
batch is right-padded to the longest row rounded up to `pad_to_multiple_of`
(`input_ids` with the pad id, `labels` with -100, `attention_mask` 0).

`sample_multiple` (context parallel's `required_multiple`) makes every sample's
length a multiple of it: without packing it joins the row multiple; with packing
each sample is followed by its own padding up to the multiple (pad ids, labels
-100, attention_mask 0), which stays inside the sample's `cu_seq_lens` segment, so
context parallel can split every packed sample. With packing the padding at the end
of a row is a segment of its own, and `cu_seq_lens` lists every segment's
boundaries over the flattened `B·S` tokens (int32, from 0 to `B·S`), so varlen
attention never mixes two samples (or a sample and padding). `max_length` is the
longest segment.

Each family's collator lives in its folder (`mmfsdp.data.families.<name>.collator`) and registers when the
registry is first asked (entry-point group `mmfsdp.data_families`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

from mmfsdp.config import Registry

from mmfsdp.data.templates import IGNORE_INDEX

__all__ = [
    "Collator",
    "KeySpec",
    "collator_names",
    "get_collator",
    "register_collator",
    "split_batch",
]


@dataclass(frozen=True, slots=True)
class KeySpec:
    """What one key of a batch is and how it packs and splits."""

    kind: Literal["input", "labels", "boundary"]
    """`input` = passed to the model as is; `labels` = the loss targets; `boundary` = sample boundaries."""
    seq_dim: int | None = None
    """The key's token dimension (split by context parallel, extended by padding); None = not per token, kept whole."""
    pad_value: int | None = None
    """What padding positions along `seq_dim` hold."""


@runtime_checkable
class Collator(Protocol):
    """Rows of samples -> one batch dict whose keys `batch_schema` declares."""

    name: ClassVar[str]
    """The name users write in `collate_param.model_name`. An optional class attribute `aliases` (tuple) lists other names that select it
    (older or alternative spellings users' YAML has)."""
    batch_schema: ClassVar[Mapping[str, KeySpec]]
    """Every key the collator may return."""

    def __init__(self, *, pad_token_id: int, pad_to_multiple_of: int = 1, packing: bool = False, sample_multiple: int = 1): ...

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]: ...


def split_batch(batch: Mapping[str, Any], schema: Mapping[str, KeySpec]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model inputs, labels, boundaries) of `batch`, by each key's `KeySpec.kind`; a key the schema lacks is a bug."""
    out: dict[str, dict[str, Any]] = {"input": {}, "labels": {}, "boundary": {}}
    for key, value in batch.items():
        out[schema[key].kind][key] = value
    return out["input"], out["labels"], out["boundary"]


_COLLATORS: Registry[type[Collator]] = Registry(
    "collator", "data.dataloader_param.collate_param.model_name", entry_point_group="mmfsdp.data_families"
)


def register_collator(cls: type) -> type:
    return _COLLATORS.register(cls.name, cls, aliases=getattr(cls, "aliases", ()))


def collator_names() -> list[str]:
    return _COLLATORS.names()


def get_collator(name: str) -> type[Collator]:
    return _COLLATORS.get(name)


_BOUNDARIES = {"cu_seq_lens": KeySpec("boundary"), "max_length": KeySpec("boundary")}


class _RowCollator:
    """Text layout shared by the collators: padding, per-sample spans and packing segments."""

    def __init__(self, *, pad_token_id: int, pad_to_multiple_of: int = 1, packing: bool = False, sample_multiple: int = 1):
        assert pad_to_multiple_of >= 1 and sample_multiple >= 1
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = math.lcm(pad_to_multiple_of, sample_multiple)
        self.packing = packing
        self.sample_multiple = sample_multiple

    def _span(self, num_tokens: int) -> int:
        """Tokens a sample occupies in its row: with packing, its length rounded up to `sample_multiple`."""
        if not self.packing:
            return num_tokens
        return math.ceil(num_tokens / self.sample_multiple) * self.sample_multiple

    def _rows(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        rows = [[r] if isinstance(r, dict) else list(r) for r in rows]
        assert rows and all(rows), "a batch needs at least one row and every row at least one sample"
        if not self.packing:
            assert all(len(r) == 1 for r in rows), "several samples in a row need packing=True"
        return rows

    def _text(self, rows: list[list[dict[str, Any]]]) -> tuple[dict[str, Any], list[list[tuple[int, int]]], list[int]]:
        """`input_ids`, `labels`, `attention_mask` `[B, S]`; each sample's (start, span) per row; the packing segments."""
        row_lens = [sum(self._span(len(s["input_ids"])) for s in row) for row in rows]
        seq_len = math.ceil(max(row_lens) / self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(rows)
        input_ids = torch.full((batch_size, seq_len), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
        spans: list[list[tuple[int, int]]] = []
        segments: list[int] = []
        for b, row in enumerate(rows):
            start = 0
            spans.append([])
            for sample in row:
                n = len(sample["input_ids"])
                span = self._span(n)
                input_ids[b, start : start + n] = sample["input_ids"]
                labels[b, start : start + n] = sample["labels"]
                attention_mask[b, start : start + n] = 1
                spans[b].append((start, span))
                segments.append(span)
                start += span
            if self.packing and seq_len > start:
                segments.append(seq_len - start)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, spans, segments

    def _boundaries(self, batch: dict[str, Any], segments: list[int]) -> None:
        if self.packing:
            cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
            assert int(cu[-1]) == batch["input_ids"].numel()
            batch["cu_seq_lens"] = cu
            batch["max_length"] = max(segments)
