"""Datasets: JSON/JSONL conversations -> a cached, tokenized, map-style torch Dataset.

The flow for one file:

1. *Raw rows* — the file is streamed and split into rows (JSONL lines, or the items of
   a JSON list, found by a bracket scan outside strings a few MiB at a time). Each row is checked
   before and after `json.loads` — UTF-8, nesting depth (`_MAX_JSON_DEPTH`, scanned
   before parsing), Python's int-str digit limit, lone surrogates — and stored with HF
   `datasets` (`Dataset.from_generator`, under `cache_dir`) as one JSON string per row;
   a row that fails is stored as a marker carrying its bad-row reason, so no row of any
   shape aborts the run. `max_samples` keeps the first N rows.
2. *Tokenized rows* — one streaming pass (batch by batch; `num_proc` forked processes) runs
   `SampleEncoder.encode_row` on every row: parse the conversation, read each image's
   header for its grid (an opaque tuple of ints from the plugin) and each video's headers
   for its sampled frames and grid, expand placeholders into the plugin's image and video
   tokens, apply the
   template and labels, truncate at `cutoff_len`. A bad row keeps its reason instead
   of tokens. The result is cached as an Arrow file named by a fingerprint of the
   file, the tokenizer and every setting that changes tokens, built under a file
   lock, so concurrent ranks build it once and later runs reuse it.
3. *`SFTDataset`* — the good rows; `dataset[i]` decodes and processes that sample's
   images and videos (the only pixel work, done lazily in DataLoader workers) and returns
   `input_ids`, `labels` and the image plugin's `pixel_inputs` (for `pixtral`:
   `pixel_values`, a list of `[3, h, w]`, and `image_sizes`).

`prepare_dataset(data_cfg)` does the work that needs no tokenizer (generating
synthetic data, step 1) and is safe to run on every rank at once before process
groups exist; `build_dataset` does steps 2–3.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np
import pyarrow.compute as pc
import torch

from mmfsdp.config import ConfigError, Registry, current_rank, get_logger, to_dict

from mmfsdp.data.balance import SampleStats, grid_blocks
from mmfsdp.data.build import build_plugin
from mmfsdp.data.config import DataConfig
from mmfsdp.data.conversation import parse_pair, parse_row
from mmfsdp.data.errors import BAD_REASONS, BadSample, DataError, all_rows_bad_message, format_counts, top_reason
from mmfsdp.data.paths import media_path
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.templates import IGNORE_INDEX, get_template

__all__ = [
    "PreferenceDataset",
    "SFTDataset",
    "SampleEncoder",
    "build_dataset",
    "check_dataset",
    "dataset_files",
    "dataset_type_names",
    "prepare_dataset",
    "register_dataset_type",
]

log = get_logger(__name__)

_PREPROCESS_VERSION = 4
"""Bump when the tokenized layout or the encoding rules change, to invalidate old caches."""
_KEY = "data.dataset_param"
_INVALID = "__mmfsdp_invalid__"
_MAX_JSON_DEPTH = 100
"""Deepest nesting of lists/objects a row may have (real conversations use about 4); deeper is `nested_too_deep`."""
_EMPTY_SAMPLE = {
    "input_ids": [], "labels": [], "images": [], "image_grids": [], "videos": [], "video_grids": [],
    "absolute_images": 0,
}
"""The token columns of a bad row (and, with the counts, the columns of the tokenized table)."""
_EMPTY_PAIR = {**_EMPTY_SAMPLE, "rejected_ids": [], "rejected_labels": [], "prompt_length": 0}
"""The token columns of a bad row of preference data: the chosen sequence in `input_ids`/`labels`, the rejected
one's tokens after the shared prompt (its first `prompt_length` tokens) in `rejected_ids`/`rejected_labels`."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_READ_BYTES = 1 << 22
"""How much of a JSON list file is read at a time (rows are split off each read, so memory stays bounded)."""


# ---------------------------------------------------------------- dataset types


@dataclass(frozen=True, slots=True)
class DatasetType:
    """A dataset source: `prepare(data_cfg)` makes its files exist, `files(data_cfg, split)` lists them."""

    name: str
    prepare: Callable[[DataConfig], None]
    files: Callable[[DataConfig, str], list[Path]]


_DATASET_TYPES: Registry[DatasetType] = Registry("dataset type", f"{_KEY}.dataset_type")


def register_dataset_type(dataset_type: DatasetType) -> DatasetType:
    return _DATASET_TYPES.register(dataset_type.name, dataset_type)


def dataset_type_names() -> list[str]:
    return _DATASET_TYPES.names()


def _dataset_type(data_cfg: DataConfig) -> DatasetType:
    return _DATASET_TYPES.get(data_cfg.dataset_param.dataset_type)


def _check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def _json_files(data_cfg: DataConfig, split: str) -> list[Path]:
    basic = data_cfg.dataset_param.basic_parameters
    key = "dataset" if split == "train" else "eval_dataset"
    value = basic.dataset if split == "train" else basic.eval_dataset
    if not value:
        what = "training data" if split == "train" else "evaluation data (or turn evaluation off)"
        raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"is not set; give the JSON/JSONL file(s) of the {what}")
    files = []
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        path = Path(item).expanduser()
        if not path.is_file() and not path.is_absolute() and (Path(basic.dataset_dir).expanduser() / path).is_file():
            path = Path(basic.dataset_dir).expanduser() / path
        if not path.is_file():
            raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"{item!r} is not a file (looked for it as given and under dataset_dir {basic.dataset_dir!r}); give the path of an existing JSON/JSONL file")
        if path.suffix not in (".json", ".jsonl"):
            raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"{item!r} must be a .json file (a list of rows) or a .jsonl file (one row per line); convert it to one of those")
        files.append(path.resolve())
    return files


def _nothing_to_prepare(data_cfg: DataConfig) -> None:
    """JSON/JSONL files are the user's; there is nothing to generate."""


def _prepare_synthetic(data_cfg: DataConfig, pairs: bool = False) -> None:
    from mmfsdp.data.plugins import get_plugin
    from mmfsdp.data.synthetic import make_shapes_dataset
    from mmfsdp.data.templates import get_template

    syn = data_cfg.dataset_param.synthetic
    dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser()
    make_shapes_dataset(  # generates when missing; data generated with other settings is an error, never reused
        dataset_dir, num_train=syn.num_train, num_eval=syn.num_eval, image_size=syn.image_size, seed=syn.seed,
        text_only_share=syn.text_only_share, pairs=pairs,
    )
    model_dir = data_cfg.dataset_param.preprocess_parameters.model_name_or_path
    if model_dir and not Path(model_dir).expanduser().exists():
        pp = data_cfg.dataset_param.preprocess_parameters
        plugin = get_plugin(pp.image_plugin or get_template(pp.template).default_plugin)
        write = getattr(plugin, "write_tiny_processor", None)
        if write is None:
            raise ConfigError(
                f"{_KEY}.preprocess_parameters.model_name_or_path",
                f"{model_dir!r} does not exist, and image plugin {plugin.name!r} cannot write a tiny processor for "
                "the synthetic data; give an existing processor directory",
            )
        write(Path(model_dir).expanduser(), image_size=syn.image_size, patch_size=syn.patch_size, spatial_merge_size=syn.spatial_merge_size)


def _synthetic_files(data_cfg: DataConfig, split: str) -> list[Path]:
    dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser()
    path = dataset_dir / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path} does not exist; call mmfsdp.data.prepare_dataset(data_cfg) first to generate the synthetic_shapes data")
    return [path.resolve()]


register_dataset_type(DatasetType("huggingface", _nothing_to_prepare, _json_files))
def _prepare_synthetic_pairs(data_cfg: DataConfig) -> None:
    _check_ranking(data_cfg)
    _prepare_synthetic(data_cfg, pairs=True)


def _synthetic_pair_files(data_cfg: DataConfig, split: str) -> list[Path]:
    _check_ranking(data_cfg)
    return _synthetic_files(data_cfg, split)


def _check_ranking(data_cfg: DataConfig) -> None:
    if not data_cfg.dataset_param.attr.ranking:
        raise ConfigError(f"{_KEY}.attr.ranking", "must be true for dataset_type synthetic_shapes_pairs (preference rows)")


register_dataset_type(DatasetType("synthetic_shapes", _prepare_synthetic, _synthetic_files))
register_dataset_type(DatasetType("synthetic_shapes_pairs", _prepare_synthetic_pairs, _synthetic_pair_files))


def dataset_files(data_cfg: DataConfig, split: str = "train") -> list[Path]:
    """The JSON/JSONL files of `split` ("train" or "eval")."""
    _check_split(split)
    return _dataset_type(data_cfg).files(data_cfg, split)


def has_eval_data(data_cfg: DataConfig) -> bool:
    """Whether the config names evaluation data (generated datasets always have an eval split)."""
    return data_cfg.dataset_param.dataset_type != "huggingface" or bool(data_cfg.dataset_param.basic_parameters.eval_dataset)


def check_dataset(data_cfg: DataConfig) -> None:
    """Checks that read nothing but the file system, for `--check` and before any rank starts.

    The dataset type must be registered (`ConfigError` with the closest name); the files
    of a type that generates nothing (JSON/JSONL) must exist and be .json/.jsonl.
    """
    if _dataset_type(data_cfg).prepare is _nothing_to_prepare:
        for split in ("train", "eval") if has_eval_data(data_cfg) else ("train",):
            dataset_files(data_cfg, split)


# ---------------------------------------------------------------- raw rows


def _cache_dir(data_cfg: DataConfig) -> Path:
    cache_dir = data_cfg.dataset_param.basic_parameters.cache_dir
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "mmfsdp" / "data"


def _structure(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets of the brackets and commas of `data` that are outside JSON strings, the nesting depth after each, and
    the offset of the first quote that opens no complete string (`len(data)` if none): a string cut off there."""
    blank = np.frombuffer(_JSON_STRING.sub(lambda m: b"_" * len(m.group()), data), dtype=np.uint8)
    opens = (blank == ord("[")) | (blank == ord("{"))
    closes = (blank == ord("]")) | (blank == ord("}"))
    offsets = np.flatnonzero(opens | closes | (blank == ord(",")))
    quotes = np.flatnonzero(blank == ord('"'))
    unclosed = int(quotes[0]) if len(quotes) else len(data)
    return offsets, np.cumsum(opens[offsets].astype(np.int32) - closes[offsets].astype(np.int32)), unclosed


def _max_depth(data: bytes) -> int:
    if data.count(b"[") + data.count(b"{") <= _MAX_JSON_DEPTH:
        return 0  # nesting cannot exceed the number of brackets: no scan needed
    return int(_structure(data)[1].max(initial=0))


def _row_json(data: bytes, where: str) -> str:
    """One row's bytes -> its JSON text, re-serialised; `BadSample` for anything that would break a later step."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadSample("not_utf8", f"{where}: byte {err.start} ({data[err.start:err.start + 1]!r}) is not UTF-8") from None
    depth = _max_depth(data)
    if depth > _MAX_JSON_DEPTH:
        raise BadSample("nested_too_deep", f"{where}: lists/objects nest {depth} deep (at most {_MAX_JSON_DEPTH})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadSample("bad_content", f"{where} is not valid JSON ({err})") from None
    except RecursionError:
        raise BadSample("nested_too_deep", f"{where}: lists/objects nest too deep to parse") from None
    except ValueError as err:  # json's only other error: an integer past sys.get_int_max_str_digits()
        raise BadSample("number_too_long", f"{where}: {str(err).split(';')[0]}") from None
    out = json.dumps(value, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadSample("lone_surrogate", f"{where}: a string holds the lone surrogate U+{ord(out[err.start]):04X} (an unpaired \\ud800-\\udfff escape)") from None
    return out


def _json_list_items(f: BinaryIO, path: str) -> Iterator[tuple[bytes, str]]:
    """(bytes, "item i") of each item of the JSON list in the open file `f`, split at the list's own commas.

    Streams: reads `_READ_BYTES` at a time and keeps only the bytes of items not yet split off. Each scan starts
    right after the list's `[` or one of its commas, so outside any string at depth 1; before the end of the file
    only the part up to the first string the read cut through is split (its commas and brackets may be text)."""
    pending, started, index, read_size = b"", False, 0, _READ_BYTES
    while True:
        chunk = f.read(read_size)
        at_end = not chunk
        pending += chunk
        if not started:
            pending = pending.lstrip()
            if not pending and not at_end:
                continue
            if not pending.startswith(b"["):
                raise DataError(f"{path} must hold a JSON list of rows (or be a .jsonl file with one row per line)")
            pending, started = pending[1:], True
        offsets, depth, unclosed = _structure(pending)
        if not at_end:
            depth, offsets = depth[offsets < unclosed], offsets[offsets < unclosed]
        depth = depth + 1
        codes = np.frombuffer(pending, dtype=np.uint8)[offsets]
        ends = offsets[(depth == 0) | ((depth == 1) & (codes == ord(",")))]
        start = 0
        for end in ends.tolist():
            item = pending[start:end]
            if pending[end] == ord(","):
                yield item, f"item {index}"
                index, start = index + 1, end + 1
                continue
            trailing = pending[end + 1 :].strip() or any(b.strip() for b in iter(lambda: f.read(_READ_BYTES), b""))
            if pending[end] != ord("]") or trailing:
                break  # the list closes with another bracket, or something follows it
            if index or item.strip():  # `[]` holds no item; `[1,]` ends with an empty one
                yield item, f"item {index}"
            return
        else:
            if not at_end:
                pending = pending[start:]
                read_size = _READ_BYTES if start else 2 * read_size  # a long item: read more before scanning again
                continue
        raise DataError(f"{path} is not valid JSON (its brackets do not balance into one list); fix the file or convert it to JSONL (one row per line)")


def _iter_json_rows(path: str, size: int, mtime_ns: int, max_samples: int | None) -> Iterator[dict[str, str]]:
    """One `{"row": json}` per row of `path`; a row that is not usable JSON becomes an invalid marker with its reason."""
    del size, mtime_ns  # in the signature so HF datasets' cache key changes when the file does
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            rows: Iterator[tuple[bytes, str]] = ((line, f"line {n}") for n, line in enumerate(f, 1) if line.strip())
            yield from _rows_json(rows, max_samples)
        return
    with open(path, "rb") as f:
        items = _json_list_items(f, path)
        yield from _rows_json(items, max_samples)
        for _ in items:  # past max_samples: the rest of the list is still checked to be one list
            pass


def _rows_json(rows: Iterator[tuple[bytes, str]], max_samples: int | None) -> Iterator[dict[str, str]]:
    for count, (data, where) in enumerate(rows):
        if max_samples is not None and count >= max_samples:
            return
        try:
            yield {"row": _row_json(data, where)}
        except BadSample as bad:
            yield {"row": json.dumps({_INVALID: [bad.reason, bad.detail]})}


def _quiet_datasets() -> None:
    """Only rank 0 shows HF datasets' progress bars."""
    import datasets

    if current_rank() != 0:
        datasets.disable_progress_bars()


def _raw_rows(path: Path, data_cfg: DataConfig) -> Any:
    import datasets

    _quiet_datasets()
    stat = path.stat()
    gen_kwargs = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "max_samples": data_cfg.dataset_param.basic_parameters.max_samples}
    features = datasets.Features({"row": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(_iter_json_rows, features=features, gen_kwargs=gen_kwargs, cache_dir=str(_cache_dir(data_cfg) / "raw"))
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, DataError):  # a file-level problem (not a list, brackets unbalanced): one line
            raise err.__cause__ from None
        raise


def prepare_dataset(data_cfg: DataConfig) -> None:
    """One-time work before training starts: generate synthetic data and cache the raw rows.

    Safe to call from several ranks at once (writes go to temporary paths that are
    renamed into place; HF datasets locks its own cache) and deterministic.
    """
    _dataset_type(data_cfg).prepare(data_cfg)
    for split in ("train", "eval") if has_eval_data(data_cfg) else ("train",):
        for path in dataset_files(data_cfg, split):
            _raw_rows(path, data_cfg)


# ---------------------------------------------------------------- tokenization


class SampleEncoder:
    """Turns a raw row into a tokenized sample (preprocessing) and a sample's image paths into pixels (workers)."""

    def __init__(self, data_cfg: DataConfig, processor: MMProcessor):
        pp = data_cfg.dataset_param.preprocess_parameters
        template_cls = get_template(pp.template)
        self.processor = processor
        self.attr = data_cfg.dataset_param.attr
        self.ranking = self.attr.ranking
        """Preference data: a row is a pair (`encode_pair`)."""
        self.cutoff_len = pp.cutoff_len
        self.dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser().resolve()
        self.allow_outside = data_cfg.dataset_param.basic_parameters.allow_paths_outside_dataset_dir
        self.template = template_cls(
            processor, train_on_prompt=pp.train_on_prompt, mask_history=pp.mask_history, enable_thinking=pp.enable_thinking,
        )
        self.plugin = build_plugin(data_cfg, processor)

    def image_path(self, path: str) -> str:
        """Where image `path` of a row is read from (`media_path`: no `..` escape, symlinks followed)."""
        return media_path(path, self.dataset_dir, allow_outside=self.allow_outside)

    def encode_row(self, row: Any) -> dict[str, Any]:
        """Tokenize one row (a parsed JSON value); raises `BadSample`."""
        if not isinstance(row, dict):
            raise BadSample("bad_content", f"a row must be a JSON object, got {type(row).__name__}")
        if _INVALID in row:
            raise BadSample(*row[_INVALID])
        pair = parse_pair(row, self.attr) if self.ranking else None
        conversation = parse_row(row, self.attr) if pair is None else pair.conversation
        if conversation.videos and not self.plugin.supports_video:
            raise BadSample(
                "video_not_supported",
                f"the row has {len(conversation.videos)} video(s), but image plugin {self.plugin.name!r} "
                "(this model family) reads no video",
            )
        paths = [self.image_path(p) for p in conversation.images]
        video_paths = [
            media_path(p, self.dataset_dir, allow_outside=self.allow_outside, reason="video_outside_dataset_dir")
            for p in conversation.videos
        ]
        grids = [self.plugin.read_grid(p) for p in paths]
        video_grids = self.plugin.read_video_grids(video_paths) if video_paths else []
        blocks = [self.plugin.image_tokens(grid) for grid in grids]
        video_blocks = [self.plugin.video_tokens(grid) for grid in video_grids]
        num_absolute = sum(Path(p).expanduser().is_absolute() for p in conversation.images + conversation.videos)
        media = {
            "images": paths, "image_grids": [list(g) for g in grids],
            "videos": video_paths, "video_grids": [list(g) for g in video_grids], "absolute_images": num_absolute,
        }
        if pair is not None:
            return {**self.encode_pair(conversation, pair.rejected, blocks, video_blocks), **media}
        input_ids, labels = self.template.encode(conversation, blocks, video_blocks)
        input_ids, labels = self.truncate(input_ids, labels)
        return {"input_ids": input_ids, "labels": labels, **media}

    def encode_pair(
        self, conversation: Any, rejected: str, blocks: list[list[int]], video_blocks: list[list[int]]
    ) -> dict[str, Any]:
        """The token columns of a pair (`_EMPTY_PAIR`): the prompt is tokenized once (`Template.encode_pair`); a
        pair with a sequence over `cutoff_len` is `pair_too_long` (DPO's answers are never cut)."""
        (ids, labels), (rejected_ids, rejected_labels) = self.template.encode_pair(
            conversation, rejected, blocks, video_blocks
        )
        for name, n in (("chosen", len(ids)), ("rejected", len(rejected_ids))):
            if n > self.cutoff_len:
                raise BadSample("pair_too_long", f"the {name} sequence has {n} tokens > cutoff_len {self.cutoff_len}")
        shared = next(
            (k for k, (a, b) in enumerate(zip(zip(ids, labels), zip(rejected_ids, rejected_labels))) if a != b),
            min(len(ids), len(rejected_ids)),
        )
        return {
            "input_ids": ids, "labels": labels, "rejected_ids": rejected_ids[shared:],
            "rejected_labels": rejected_labels[shared:], "prompt_length": shared,
        }

    def truncate(self, input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Cut to `cutoff_len` in text only; a cut through an image block, or one that leaves nothing trained, is `too_long`."""
        n = len(input_ids)
        if n <= self.cutoff_len:
            return input_ids, labels
        image_ids = self.plugin.image_token_ids
        last_image = max((i for i in range(n - 1, -1, -1) if input_ids[i] in image_ids), default=-1)
        if last_image >= self.cutoff_len:
            raise BadSample("too_long", f"{n} tokens > cutoff_len {self.cutoff_len} and the cut would go through image tokens (the last ends at {last_image + 1})")
        input_ids, labels = input_ids[: self.cutoff_len], labels[: self.cutoff_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            raise BadSample("too_long", f"{n} tokens > cutoff_len {self.cutoff_len} and nothing trained is left before the cut")
        return input_ids, labels

    def encode_batch(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """`datasets.map` function: raw JSON rows -> token columns plus `bad_reason`/`bad_detail`."""
        empty = _EMPTY_PAIR if self.ranking else _EMPTY_SAMPLE
        keys = (*empty, "length", "bad_reason", "bad_detail")
        out: dict[str, list[Any]] = {k: [] for k in keys}
        for text in batch["row"]:
            try:
                sample = self.encode_row(json.loads(text))
                bad_reason = bad_detail = ""
            except BadSample as bad:
                sample = dict(empty)
                bad_reason, bad_detail = bad.reason, bad.detail
            for key, value in sample.items():
                out[key].append(value)
            # a pair's length is both sequences': what batching, packing and the token budget plan with
            rejected_length = sample["prompt_length"] + len(sample["rejected_ids"]) if self.ranking and not bad_reason else 0
            out["length"].append(len(sample["input_ids"]) + rejected_length)
            out["bad_reason"].append(bad_reason)
            out["bad_detail"].append(bad_detail)
        return out

    def fingerprint(self) -> str:
        """Hash of everything that changes the tokens: tokenizer, image processor, template and options."""
        tok = self.processor.tokenizer
        h = hashlib.sha256()
        h.update(type(tok).__name__.encode())
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
        probe = ["Hello, wörld! 12345  tabs\tand\nnew lines... ¿Qué tal? 日本語 [INST] <s>", " leading", "trailing "]
        h.update(json.dumps(self.processor.encode_texts(probe)).encode())
        h.update(json.dumps(self.processor.image_processor.to_dict(), sort_keys=True, default=str).encode())
        h.update(
            json.dumps(
                [
                    _PREPROCESS_VERSION,
                    self.template.fingerprint(),
                    self.plugin.fingerprint(),
                    self.cutoff_len,
                    str(self.dataset_dir),
                    self.allow_outside,
                    to_dict(self.attr),
                ]
            ).encode()
        )
        return h.hexdigest()


def _features(ranking: bool = False) -> Any:
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
    pair_columns = {
        "rejected_ids": seq(datasets.Value("int32")),
        "rejected_labels": seq(datasets.Value("int32")),
        "prompt_length": datasets.Value("int32"),
    }
    return datasets.Features(
        {
            **(pair_columns if ranking else {}),
            "input_ids": seq(datasets.Value("int32")),
            "labels": seq(datasets.Value("int32")),
            "images": seq(datasets.Value("string")),
            "image_grids": seq(seq(datasets.Value("int32"))),
            "videos": seq(datasets.Value("string")),
            "video_grids": seq(seq(datasets.Value("int64"))),
            "absolute_images": datasets.Value("int32"),
            "length": datasets.Value("int32"),
            "bad_reason": datasets.Value("string"),
            "bad_detail": datasets.Value("string"),
        }
    )


def _stream_batches(filename: str) -> Iterator[Any]:
    """The Arrow record batches of the cache file `filename`, read as a stream (`pa.OSFile`, not memory-mapped: the
    pages of a mapped file that a scan touches would stay in the process's RSS until the mapping goes). Each batch is
    freed once the caller moves on, so a scan over all rows takes memory that does not grow with them."""
    import pyarrow as pa

    with pa.OSFile(filename) as f:
        yield from pa.ipc.open_stream(f)


def _raw_batches(raw: Any) -> Iterator[list[str]]:
    """The raw rows' JSON texts, one Arrow record batch at a time, read as a stream."""
    for cache_file in raw.cache_files:
        for batch in _stream_batches(cache_file["filename"]):
            yield batch.column("row").to_pylist()


_worker_encoder: SampleEncoder | None = None
"""The encoder of a `num_proc` worker process (forked with it: nothing is pickled but the rows)."""


def _set_worker_encoder(encoder: SampleEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(rows: list[str]) -> dict[str, list[Any]]:
    assert _worker_encoder is not None
    return _worker_encoder.encode_batch({"row": rows})


def _encoded_batches(raw: Any, encoder: SampleEncoder, num_proc: int) -> Iterator[dict[str, list[Any]]]:
    """`encoder.encode_batch` of every raw batch, in file order; with `num_proc` > 1 in that many forked processes,
    at most two batches per process in flight, so memory stays bounded however many rows the file has."""
    if num_proc <= 1:
        for rows in _raw_batches(raw):
            yield encoder.encode_batch({"row": rows})
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(num_proc, _set_worker_encoder, (encoder,)) as pool:
        in_flight: deque[Any] = deque()
        for rows in _raw_batches(raw):
            in_flight.append(pool.apply_async(_encode_in_worker, (rows,)))
            if len(in_flight) >= 2 * num_proc:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def _tokenized_rows(path: Path, data_cfg: DataConfig, encoder: SampleEncoder, encoder_fp: str) -> str:
    """The tokenized Arrow file of `path`: found in the cache, else built by one streaming pass over the raw rows
    (batch by batch: raw rows in, token columns out to the Arrow file) and published by a rename."""
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils.tqdm import tqdm
    from filelock import FileLock

    basic = data_cfg.dataset_param.basic_parameters
    stat = path.stat()
    fp = hashlib.sha256(json.dumps([encoder_fp, str(path), stat.st_size, stat.st_mtime_ns, basic.max_samples]).encode()).hexdigest()[:24]
    out_dir = _cache_dir(data_cfg) / "tokenized"
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_file = out_dir / f"{path.stem}-{fp}.arrow"
    with FileLock(str(cache_file) + ".lock"):
        if basic.overwrite_cache or not cache_file.is_file():
            raw = _raw_rows(path, data_cfg)
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
            try:
                with tqdm(total=len(raw), unit=" examples", desc=f"tokenizing {path.name}") as progress:
                    with ArrowWriter(features=_features(encoder.ranking), path=str(tmp)) as writer:
                        for out in _encoded_batches(raw, encoder, basic.num_proc or 1):
                            writer.write_batch(out)
                            progress.update(len(out["length"]))
                        writer.finalize()
                os.replace(tmp, cache_file)
            finally:
                tmp.unlink(missing_ok=True)
        return str(cache_file)


# ---------------------------------------------------------------- the dataset


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


def _mapped_table(cache_file: str) -> Any:
    """The tokenized table of `cache_file`, memory-mapped (HF datasets): what reading one sample's record uses."""
    import datasets

    return datasets.Dataset.from_file(cache_file)


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
    _table_columns = ("input_ids", "labels", "images", "image_grids", "videos", "video_grids")

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
        columns = ["bad_reason", "bad_detail", "length", "absolute_images", "images", "videos"]
        for source, cache_file in enumerate(self._cache_files):
            first_row = 0
            for batch in _stream_batches(cache_file):
                if first_row + batch.num_rows > _MAX_ROW:
                    raise DataError(f"{self.sources[source]} has over {_MAX_ROW} rows; split it into several files")
                reasons, details, lengths, absolute, images, videos = (batch.column(c) for c in columns)
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
                for kind, paths in (("image", images), ("video", videos)):
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
            self._mapped = [_mapped_table(f).select_columns(list(self._table_columns)) for f in self._cache_files]
        return self._mapped

    def media_grids(self) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
        """(image grids, video grids) of every sample in order, from the stored grids (no pixels read), read as a
        stream one Arrow batch at a time: a pass over all samples keeps nothing per sample."""
        for cache_file in self._cache_files:
            for batch in _stream_batches(cache_file):
                good = pc.equal(batch.column("bad_reason"), "")
                images = batch.column("image_grids").filter(good).to_pylist()
                videos = batch.column("video_grids").filter(good).to_pylist()
                del batch, good
                yield from zip(images, videos)

    def sample_stats(self) -> SampleStats:
        """Tokens and vision patches of every sample, from the stored grids (no pixels read): what the
        token budget and the balance plan with (`mmfsdp.data.balance`)."""
        patches = np.zeros(len(self), dtype=np.int64)
        patch_sq = np.zeros(len(self), dtype=np.int64)
        for index, (images, videos) in enumerate(self.media_grids()):
            if images or videos:
                blocks = [grid_blocks(grid) for grid in (*images, *(g[:3] for g in videos))]
                patches[index] = sum(block * count for block, count in blocks)
                patch_sq[index] = sum(block * block * count for block, count in blocks)
        return SampleStats(self.lengths.astype(np.int64), patches, patch_sq)

    def media_kinds(self) -> frozenset[str]:
        """The kinds of media (`"image"`, `"video"`) at least one usable sample holds, from the stored paths (no
        pixels read; found while the dataset was built). The model runs a vision placeholder pass only for these
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
        """The pixel inputs of sample `index`'s images and videos (decoded here), or its bad-row reason."""
        if not (record["images"] or record["videos"]):
            return {}
        plugin = self.encoder.plugin
        media: dict[str, Any] = {}
        try:
            if record["images"]:
                media.update(plugin.pixel_inputs(record["images"], [tuple(g) for g in record["image_grids"]]))
            if record["videos"]:
                media.update(plugin.video_inputs(record["videos"], [tuple(g) for g in record["video_grids"]]))
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


def _first_bad_row(files: list[Path], cache_files: list[str], reason: str | None) -> tuple[str, int, str] | None:
    """(file, row, detail) of the first row skipped for `reason`, for the all-bad error's example."""
    for path, cache_file in zip(files, cache_files):
        table = _mapped_table(cache_file)
        row = pc.index(table.data.column("bad_reason"), reason or "").as_py() if reason else -1
        if row >= 0:
            return str(path), row, table[row]["bad_detail"]
    return None


def build_dataset(data_cfg: DataConfig, processor: MMProcessor, split: str = "train") -> SFTDataset:
    """The tokenized, filtered dataset of `split`; images are decoded only when an item is read. With
    `attr.ranking: true` a `PreferenceDataset`, whose items are pairs."""
    _check_split(split)
    files = dataset_files(data_cfg, split)
    encoder = SampleEncoder(data_cfg, processor)
    encoder_fp = encoder.fingerprint()
    cache_files = [_tokenized_rows(path, data_cfg, encoder, encoder_fp) for path in files]
    strict = data_cfg.dataset_param.basic_parameters.strict
    dataset_cls = PreferenceDataset if encoder.ranking else SFTDataset
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
        "pairs" if dataset.is_preference else "samples",
        names,
        dataset.num_rows,
        f"; skipped {skipped}: {format_counts(dataset.bad_row_counts)}" if skipped else "",
        f"; {dataset.absolute_image_rows} use absolute image paths" if dataset.absolute_image_rows else "",
        int(dataset.lengths.sum()),
        int(dataset.lengths.max()),
    )
    return dataset

