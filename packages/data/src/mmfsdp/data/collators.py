"""Collators: rows of samples -> one padded batch dict, a registry keyed by `collate_param.model_name`.

A collator receives *rows*, each a list of samples (one sample per row without packing, several with
packing), and returns a batch that keeps the batch contract of docs/data.md, "Batches" (per-token keys
`[B, S]` right-padded, per-media keys in sample order, `cu_seq_lens` / `max_length` with packing).
`_RowCollator` is the row layout every collator shares: padding, each sample's span in its row and the
packing segments. `sample_multiple` (context parallel's `required_multiple`) pads every packed sample to a
multiple of it inside its own segment, so context parallel can split every sample (docs/parallelism.md).

Each family's collator lives in its folder (`mmfsdp.data.families.<name>.collator`) and registers when the
registry is first asked (entry-point group `mmfsdp.data_families`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

from mmfsdp.config import Registry

from mmfsdp.data.templates import IGNORE_INDEX

__all__ = [
    "Collator",
    "PAIR_KEYS",
    "PairCollator",
    "PromptCollator",
    "collator_names",
    "get_collator",
    "register_collator",
]


@runtime_checkable
class Collator(Protocol):
    """Rows of samples -> one batch dict that keeps the batch contract (docs/data.md, "Batches")."""

    name: ClassVar[str]
    """The name users write in `collate_param.model_name`. An optional class attribute `aliases` (tuple) lists other names that select it
    (older or alternative spellings users' YAML has)."""

    def __init__(self, *, pad_token_id: int, pad_to_multiple_of: int = 1, packing: bool = False, sample_multiple: int = 1): ...

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]: ...


_COLLATORS: Registry[type[Collator]] = Registry(
    "collator", "data.dataloader_param.collate_param.model_name", entry_point_group="mmfsdp.data_families"
)


def register_collator(cls: type) -> type:
    return _COLLATORS.register(cls.name, cls, aliases=getattr(cls, "aliases", ()))


def collator_names() -> list[str]:
    return _COLLATORS.names()


def get_collator(name: str) -> type[Collator]:
    return _COLLATORS.get(name)




class _RowCollator:
    """Text layout shared by the collators: padding, per-sample spans and packing segments."""

    def __init__(self, *, pad_token_id: int, pad_to_multiple_of: int = 1, packing: bool = False, sample_multiple: int = 1):
        assert pad_to_multiple_of >= 1 and sample_multiple >= 1
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = math.lcm(pad_to_multiple_of, sample_multiple)
        self.packing = packing
        self.sample_multiple = sample_multiple
        self.pad_in_last_sample = False
        """With packing: a row's end padding joins its last sample's segment instead of being a segment of its own
        (`PairCollator` sets it, so that segment k is sequence k)."""

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
            if self.packing and seq_len > start and self.pad_in_last_sample:
                last_start, last_span = spans[b][-1]
                spans[b][-1] = (last_start, last_span + seq_len - start)
                segments[-1] += seq_len - start
            elif self.packing and seq_len > start:
                segments.append(seq_len - start)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, spans, segments

    def _boundaries(self, batch: dict[str, Any], segments: list[int]) -> None:
        if self.packing:
            cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
            assert int(cu[-1]) == batch["input_ids"].numel()
            batch["cu_seq_lens"] = cu
            batch["max_length"] = max(segments)


PAIR_KEYS = ("pair_index",)
"""Keys a preference batch adds to the batch contract that are not model inputs."""


class PairCollator:
    """Preference micro-batches: rows of pairs -> a batch of the wrapped collator over their sequences.

    The sequences go in the order chosen_0, rejected_0, chosen_1, rejected_1, ... (pairs in row-major order):
    padded, each sequence is a row (`2 × pairs` rows); with packing (padding-free: one row), a row's pairs become
    its samples in that order, so sequence k is segment k of `cu_seq_lens` — a row's end padding joins its last
    sequence's segment (`pad_in_last_sample`), so there are exactly `2 × pairs` segments. Each sequence carries
    its own copy of the pair's pixel inputs, so the media of sequence k match its placeholder tokens.
    `pair_index` (int64 `[pairs]`) is each pair's dataset index, in the same order.
    """

    def __init__(self, collator: Any):
        self.collator = collator
        self.collator.pad_in_last_sample = True

    @property
    def packing(self) -> bool:
        return self.collator.packing

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = [[r] if isinstance(r, dict) else list(r) for r in rows]
        pairs = [pair for row in rows for pair in row]
        if self.packing:
            sequences = [[s for pair in row for s in (pair["chosen"], pair["rejected"])] for row in rows]
        else:
            assert all(len(row) == 1 for row in rows), "several pairs in a row need packing=True"
            sequences = [[pair[key]] for pair in pairs for key in ("chosen", "rejected")]
        batch = self.collator(sequences)
        batch["pair_index"] = torch.tensor([pair["pair_index"] for pair in pairs], dtype=torch.long)
        return batch


class PromptCollator:
    """Prompt micro-batches (online RL): rows of prompts -> `{"prompts": [item, ...]}`, the `PromptDataset` items in
    row-major order, uncollated. The stage generates completions from each prompt and collates its training
    sequences (prompt + completion) itself, with the wrapped family collator (`collator`)."""

    def __init__(self, collator: Any):
        self.collator = collator

    @property
    def packing(self) -> bool:
        return self.collator.packing

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = [[r] if isinstance(r, dict) else list(r) for r in rows]
        return {"prompts": [item for row in rows for item in row]}
