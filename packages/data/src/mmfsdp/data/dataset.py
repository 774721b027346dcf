"""Datasets: JSON/JSONL conversations -> a cached, tokenized, map-style torch Dataset.

The flow for one file, each step in its own module:

1. *Raw rows* — the file is streamed and split into rows, each checked and stored as one JSON string
   (`mmfsdp.data.json_rows`, the JSON stream parser; cached by `mmfsdp.data.token_cache.raw_rows`); a row that
   fails is stored as a marker carrying its bad-row reason, so no row of any shape aborts the run.
2. *Tokenized rows* — one streaming pass runs `SampleEncoder.encode_row` (`mmfsdp.data.encoder`) on every row:
   conversation, media grids, template, labels, truncation; a bad row keeps its reason instead of tokens. The
   result is an Arrow file keyed by a fingerprint of the file, the tokenizer and every setting that changes
   tokens (`mmfsdp.data.token_cache.tokenized_rows`), built once under a file lock.
3. *`SFTDataset`* (here) — the good rows; `dataset[i]` decodes and processes that sample's
   images, videos and audio clips (the only pixel and audio work, done lazily in DataLoader workers) and returns
   `input_ids`, `labels` and the image plugin's `pixel_inputs` (for `pixtral`:
   `pixel_values`, a list of `[3, h, w]`, and `image_sizes`). With `attr.ranking: true` a row is a preference
   pair, encoded with its prompt tokenized once (`SampleEncoder.encode_pair`), and the dataset is a
   `PreferenceDataset`, whose item is the pair's two sequences (docs/data.md, "Preference data"). With
   `attr.prompt_only: true` a row is a prompt for online RL (`SampleEncoder.encode_prompt`) and the dataset is a
   `PromptDataset`, whose item is the prompt's tokens and media with its ground truth (docs/data.md, "Prompt data").

Where the files come from is the dataset type (`mmfsdp.data.dataset_types`, the registry keyed by
`dataset_param.dataset_type`; the synthetic types generate theirs, `mmfsdp.data.synthetic`).
`prepare_dataset(data_cfg)` does the work that needs no tokenizer (generating
synthetic data, step 1) and is safe to run on every rank at once before process
groups exist; `build_dataset` does steps 2–3. The names of those modules that were this module's are
importable from here too.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.compute as pc
import torch

from mmfsdp.config import get_logger

from mmfsdp.data.balance import SampleStats, grid_blocks
from mmfsdp.data.config import DataConfig
from mmfsdp.data.dataset_types import (
    DatasetType,
    check_dataset,
    check_split,
    dataset_files,
    dataset_type_names,
    get_dataset_type,
    has_eval_data,
    register_dataset_type,
)
from mmfsdp.data.encoder import SampleEncoder
from mmfsdp.data.errors import BAD_REASONS, BadSample, DataError, all_rows_bad_message, format_counts, top_reason
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.token_cache import mapped_table, raw_rows, stream_batches, tokenized_rows

__all__ = [
    "DatasetType",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "SampleEncoder",
    "build_dataset",
    "check_dataset",
    "dataset_files",
    "dataset_type_names",
    "has_eval_data",
    "prepare_dataset",
    "register_dataset_type",
]

log = get_logger(__name__)


def prepare_dataset(data_cfg: DataConfig) -> None:
    """One-time work before training starts: generate synthetic data and cache the raw rows.

    Safe to call from several ranks at once (writes go to temporary paths that are
    renamed into place; HF datasets locks its own cache) and deterministic.
    """
    get_dataset_type(data_cfg).prepare(data_cfg)
    for split in ("train", "eval") if has_eval_data(data_cfg) else ("train",):
        for path in dataset_files(data_cfg, split):
            raw_rows(path, data_cfg)


class _StrictDecodeError(DataError):
    """A strict-mode image decode failure, raised inside a DataLoader worker.

    torch re-raises a worker's exception in the training process as `type(text)`, where
    `text` is "Caught ... in DataLoader worker N.\nOriginal Traceback ...: <message>";
    this type keeps only the original one-line message, so the user sees one line.
    """

    def __init__(self, message: str):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().splitlines()[-1].partition(": ")[2] or message
        super().__init__(message)


_MAX_ROW = np.iinfo(np.int32).max


class SFTDataset(torch.utils.data.Dataset):
    """The usable samples of one split; `dataset[i]` decodes sample i's images and returns its tensors.

    What it keeps per sample is one int32 array of (row in its file, token count): 8 bytes, the index and the lengths
    that batching and packing plan with. The tokens, paths and grids stay in the Arrow cache files: scans over all
    samples (this constructor, `media_grids`, `sample_stats`) read them as a stream batch by batch, and a sample's
    record is read from the memory-mapped file, which is opened on the first record read (in training: in the
    DataLoader workers), so building the dataset and its statistics takes memory that does not grow with the rows.
    """

    is_preference = False
    """Whether an item is a preference pair (`PreferenceDataset`) rather than one sample."""
    _table_columns = ("input_ids", "labels", "images", "image_grids", "videos", "video_grids", "audios", "audio_grids")

    def __init__(self, cache_files: list[str], sources: list[Path], encoder: SampleEncoder, *, strict: bool):
        self.encoder = encoder
        self.sources = [str(s) for s in sources]
        self.strict = strict
        self._cache_files = list(cache_files)
        self._mapped: list[Any] | None = None
        samples = np.zeros((0, 2), dtype=np.int32)
        size, starts = 0, [0]
        counts: Counter[str] = Counter()
        kinds: set[str] = set()
        self.num_rows = 0
        self.absolute_image_rows = 0
        """Usable samples with at least one absolute image or video path (allowed, but reported: they bypass
        `dataset_dir`)."""
        self.first_bad_row: tuple[int, int, str, str] | None = None
        """(source index, row, reason, detail) of the first row skipped, in file order (what `strict` reports)."""
        columns = ["bad_reason", "bad_detail", "length", "absolute_images", "images", "videos", "audios"]
        for source, cache_file in enumerate(self._cache_files):
            first_row = 0
            for batch in stream_batches(cache_file):
                if first_row + batch.num_rows > _MAX_ROW:
                    raise DataError(f"{self.sources[source]} has over {_MAX_ROW} rows; split it into several files")
                reasons, details, lengths, absolute, images, videos, audios = (batch.column(c) for c in columns)
                good_mask = pc.equal(reasons, "")
                good = np.flatnonzero(good_mask.to_numpy(zero_copy_only=False))
                if good.size < batch.num_rows:
                    counts.update({c["values"]: c["counts"] for c in pc.value_counts(reasons).to_pylist()})
                    if self.first_bad_row is None:
                        bad = int(np.flatnonzero(~good_mask.to_numpy(zero_copy_only=False))[0])
                        self.first_bad_row = (source, first_row + bad, reasons[bad].as_py(), details[bad].as_py())
                end = size + good.size
                if end > len(samples):  # grows in place (realloc) by doubling; trimmed to size at the end
                    samples.resize((max(end, 2 * len(samples), 1024), 2), refcheck=False)
                samples[size:end, 0] = good + first_row
                samples[size:end, 1] = lengths.to_numpy()[good]
                self.absolute_image_rows += int(np.count_nonzero(absolute.to_numpy()[good]))
                for kind, paths in (("image", images), ("video", videos), ("audio", audios)):
                    if kind not in kinds and pc.max(pc.list_value_length(paths.filter(good_mask))).as_py():
                        kinds.add(kind)
                size, first_row = end, first_row + batch.num_rows
            self.num_rows += first_row
            starts.append(size)
        samples.resize((size, 2), refcheck=False)
        self._samples = samples
        self._starts = starts
        self._media_kinds = frozenset(kinds)
        self.lengths = samples[:, 1]
        """Token count of every sample (what packing and batching plan with; int32, a view of the index)."""
        self.bad_row_counts = {r: counts[r] for r in BAD_REASONS if counts[r]}
        """Rows skipped while preprocessing, by reason."""

    @property
    def processor(self) -> MMProcessor:
        return self.encoder.processor

    @property
    def _tables(self) -> list[Any]:
        if self._mapped is None:
            self._mapped = [mapped_table(f).select_columns(list(self._table_columns)) for f in self._cache_files]
        return self._mapped

    def media_grids(self) -> Iterator[tuple[list[list[int]], list[list[int]], list[list[int]]]]:
        """(image grids, video grids, audio grids) of every sample in order, from the stored grids (no pixels read),
        read as a stream one Arrow batch at a time: a pass over all samples keeps nothing per sample."""
        for cache_file in self._cache_files:
            for batch in stream_batches(cache_file):
                good = pc.equal(batch.column("bad_reason"), "")
                kinds = ("image_grids", "video_grids", "audio_grids")
                columns = [batch.column(c).filter(good).to_pylist() for c in kinds]
                del batch, good
                yield from zip(*columns)

    def sample_stats(self) -> SampleStats:
        """Tokens and vision patches of every sample, from the stored grids (no pixels read): what the
        token budget and the balance plan with (`mmfsdp.data.balance`). Audio clips count by their tokens only."""
        patches = np.zeros(len(self), dtype=np.int64)
        patch_sq = np.zeros(len(self), dtype=np.int64)
        for index, (images, videos, _) in enumerate(self.media_grids()):
            if images or videos:
                blocks = [grid_blocks(grid) for grid in (*images, *(g[:3] for g in videos))]
                patches[index] = sum(block * count for block, count in blocks)
                patch_sq[index] = sum(block * block * count for block, count in blocks)
        return SampleStats(self.lengths.astype(np.int64), patches, patch_sq)

    def media_kinds(self) -> frozenset[str]:
        """The kinds of media (`"image"`, `"video"`, `"audio"`) at least one usable sample holds, from the stored paths
        (no pixels read; found while the dataset was built). The model runs a vision placeholder pass only for these
        kinds (`TrainingForwardMixin.set_media_kinds`): every rank's micro-batches come from them."""
        return self._media_kinds

    def __len__(self) -> int:
        return len(self._samples)

    def _source_row(self, index: int) -> tuple[int, int]:
        index = int(index)
        row = int(self._samples[index, 0])  # IndexError past either end
        if index < 0:
            index += len(self)
        return bisect.bisect_right(self._starts, index) - 1, row

    def location(self, index: int) -> tuple[str, int]:
        """(file, row index in that file) of sample `index`."""
        source, row = self._source_row(index)
        return self.sources[source], row

    def record(self, index: int) -> dict[str, Any]:
        """The stored tokenized row of sample `index` (lists; no pixels)."""
        source, row = self._source_row(index)
        return self._tables[source][row]

    def _sequence(self, input_ids: list[int], labels: list[int]) -> dict[str, Any]:
        """One sequence's token tensors: `input_ids`, `labels` and the plugin's per-token inputs."""
        item: dict[str, Any] = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }
        item.update(self.encoder.plugin.token_inputs(item["input_ids"]))
        return item

    def _media(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        """The pixel and audio inputs of sample `index`'s images, videos and clips (decoded here), or its bad-row
        reason."""
        if not (record["images"] or record["videos"] or record["audios"]):
            return {}
        plugin = self.encoder.plugin
        media: dict[str, Any] = {}
        try:
            if record["images"]:
                media.update(plugin.pixel_inputs(record["images"], [tuple(g) for g in record["image_grids"]]))
            if record["videos"]:
                media.update(plugin.video_inputs(record["videos"], [tuple(g) for g in record["video_grids"]]))
            if record["audios"]:
                media.update(plugin.audio_inputs(record["audios"], [tuple(g) for g in record["audio_grids"]]))
        except BadSample as bad:
            source, row = self.location(index)
            if self.strict:
                raise _StrictDecodeError(f"{source} row {row}: {bad.reason}: {bad.detail}") from None
            return {"bad_reason": bad.reason, "bad_detail": bad.detail}
        return media

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.record(index)
        media = self._media(index, record)
        if "bad_reason" in media:
            return media
        return {**self._sequence(record["input_ids"], record["labels"]), **media}


class PreferenceDataset(SFTDataset):
    """The usable pairs of a preference split (`attr.ranking: true`): `dataset[i]` is pair i,
    `{"chosen": sample, "rejected": sample, "pair_index": i}`, each sample what `SFTDataset` returns for one
    sequence (the prompt and that answer), both carrying the same pixel inputs, decoded once per pair.

    Batching plans with pairs: `lengths` are both sequences' tokens, and `sample_stats` counts the pair's vision
    patches twice (each sequence runs them). The collator (`PairCollator`) lays the two sequences out side by side.
    """

    is_preference = True
    _table_columns = (*SFTDataset._table_columns, "rejected_ids", "rejected_labels", "prompt_length")

    def sample_stats(self) -> SampleStats:
        stats = SFTDataset.sample_stats(self)
        return SampleStats(stats.tokens, 2 * stats.patches, 2 * stats.patch_sq)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.record(index)
        media = self._media(index, record)
        if "bad_reason" in media:
            return media
        prompt = record["prompt_length"]
        rejected_ids = record["input_ids"][:prompt] + record["rejected_ids"]
        rejected_labels = record["labels"][:prompt] + record["rejected_labels"]
        return {
            "chosen": {**self._sequence(record["input_ids"], record["labels"]), **media},
            "rejected": {**self._sequence(rejected_ids, rejected_labels), **media},
            "pair_index": int(index) % len(self),
        }


class PromptDataset(SFTDataset):
    """The usable prompts of a split (`attr.prompt_only: true`, online RL): `dataset[i]` is what `SFTDataset` returns
    for the prompt's tokens (labels all ignored: nothing of a prompt is trained) and media, with `prompt_index` (i),
    `solution` (the ground truth, decoded from its JSON), `prompt_text` (the last user message) and `image_paths` (its
    image files, in order: an engine in another process reads them, `RolloutRequest.images`). The collator
    (`PromptCollator`) keeps the items as they are: the stage generates from them and builds its own batches."""

    is_prompt = True
    """Whether an item is a prompt to generate from (`PromptDataset`)."""
    _table_columns = (*SFTDataset._table_columns, "solution", "prompt_text")

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.record(index)
        media = self._media(index, record)
        if "bad_reason" in media:
            return media
        return {
            **self._sequence(record["input_ids"], record["labels"]), **media, "prompt_index": int(index) % len(self),
            "solution": json.loads(record["solution"]), "prompt_text": record["prompt_text"],
            "image_paths": tuple(record["images"] or ()),
        }


def _first_bad_row(files: list[Path], cache_files: list[str], reason: str | None) -> tuple[str, int, str] | None:
    """(file, row, detail) of the first row skipped for `reason`, for the all-bad error's example."""
    for path, cache_file in zip(files, cache_files):
        table = mapped_table(cache_file)
        row = pc.index(table.data.column("bad_reason"), reason or "").as_py() if reason else -1
        if row >= 0:
            return str(path), row, table[row]["bad_detail"]
    return None


def build_dataset(data_cfg: DataConfig, processor: MMProcessor, split: str = "train") -> SFTDataset:
    """The tokenized, filtered dataset of `split`; images are decoded only when an item is read. With
    `attr.ranking: true` a `PreferenceDataset`, whose items are pairs."""
    check_split(split)
    files = dataset_files(data_cfg, split)
    encoder = SampleEncoder(data_cfg, processor)
    encoder_fp = encoder.fingerprint()
    cache_files = [tokenized_rows(path, data_cfg, encoder, encoder_fp) for path in files]
    strict = data_cfg.dataset_param.basic_parameters.strict
    dataset_cls = PreferenceDataset if encoder.ranking else PromptDataset if encoder.prompt_only else SFTDataset
    dataset = dataset_cls(cache_files, files, encoder, strict=strict)
    if strict and dataset.first_bad_row is not None:
        source, row, reason, detail = dataset.first_bad_row
        raise DataError(
            f"{files[source]} row {row}: {reason}: {detail} (strict: true "
            "stops at the first bad row; set it false to skip and count bad rows)"
        )
    names = ", ".join(p.name for p in files)
    if len(dataset) == 0:
        counts = dataset.bad_row_counts
        example = _first_bad_row(files, cache_files, top_reason(counts))
        raise DataError(all_rows_bad_message(dataset.num_rows, names, counts, example))
    skipped = dataset.num_rows - len(dataset)
    log.info(
        "data: %s: %d %s from %s (%d rows%s%s), %d tokens, longest %d",
        split,
        len(dataset),
        "pairs" if dataset.is_preference else "prompts" if getattr(dataset, "is_prompt", False) else "samples",
        names,
        dataset.num_rows,
        f"; skipped {skipped}: {format_counts(dataset.bad_row_counts)}" if skipped else "",
        f"; {dataset.absolute_image_rows} use absolute image paths" if dataset.absolute_image_rows else "",
        int(dataset.lengths.sum()),
        int(dataset.lengths.max()),
    )
    return dataset

