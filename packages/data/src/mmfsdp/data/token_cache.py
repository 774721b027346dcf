"""The preprocessing caches: each data file's raw rows and tokenized rows, as Arrow files built once.

1. *Raw rows* (`raw_rows`): the file streamed through the JSON stream parser (`mmfsdp.data.json_rows`) and stored
   with HF `datasets` (`Dataset.from_generator`, under `cache_dir`) as one JSON string per row; `max_samples`
   keeps the first N rows.
2. *Tokenized rows* (`tokenized_rows`): one streaming pass (batch by batch; `num_proc` forked processes) runs
   `SampleEncoder.encode_batch` over the raw rows. The result is cached as an Arrow file named by a fingerprint of
   the file, the tokenizer and every setting that changes tokens (`SampleEncoder.fingerprint`), built under a file
   lock and published by a rename, so concurrent ranks build it once and later runs reuse it.

Scans read the Arrow files as streams (`stream_batches`), one record batch at a time, so memory does not grow
with the rows; reading one sample's record uses the memory-mapped table (`mapped_table`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from mmfsdp.config import current_rank

from mmfsdp.data.config import DataConfig
from mmfsdp.data.encoder import SampleEncoder
from mmfsdp.data.errors import DataError
from mmfsdp.data.json_rows import iter_json_rows

__all__ = ["mapped_table", "raw_rows", "stream_batches", "tokenized_rows"]


def _cache_dir(data_cfg: DataConfig) -> Path:
    cache_dir = data_cfg.dataset_param.basic_parameters.cache_dir
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "mmfsdp" / "data"


def _quiet_datasets() -> None:
    """Only rank 0 shows HF datasets' progress bars."""
    import datasets

    if current_rank() != 0:
        datasets.disable_progress_bars()


def raw_rows(path: Path, data_cfg: DataConfig) -> Any:
    import datasets

    _quiet_datasets()
    stat = path.stat()
    gen_kwargs = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "max_samples": data_cfg.dataset_param.basic_parameters.max_samples}
    features = datasets.Features({"row": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(iter_json_rows, features=features, gen_kwargs=gen_kwargs, cache_dir=str(_cache_dir(data_cfg) / "raw"))
    except datasets.exceptions.DatasetGenerationError as err:
        if isinstance(err.__cause__, DataError):  # a file-level problem (not a list, brackets unbalanced): one line
            raise err.__cause__ from None
        raise


def _features(ranking: bool = False, prompt_only: bool = False) -> Any:
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
    pair_columns = {
        "rejected_ids": seq(datasets.Value("int32")),
        "rejected_labels": seq(datasets.Value("int32")),
        "prompt_length": datasets.Value("int32"),
    }
    prompt_columns = {"solution": datasets.Value("string"), "prompt_text": datasets.Value("string")}
    return datasets.Features(
        {
            **(pair_columns if ranking else {}),
            **(prompt_columns if prompt_only else {}),
            "input_ids": seq(datasets.Value("int32")),
            "labels": seq(datasets.Value("int32")),
            "images": seq(datasets.Value("string")),
            "image_grids": seq(seq(datasets.Value("int32"))),
            "videos": seq(datasets.Value("string")),
            "video_grids": seq(seq(datasets.Value("int64"))),
            "audios": seq(datasets.Value("string")),
            "audio_grids": seq(seq(datasets.Value("int64"))),
            "absolute_images": datasets.Value("int32"),
            "length": datasets.Value("int32"),
            "bad_reason": datasets.Value("string"),
            "bad_detail": datasets.Value("string"),
        }
    )


def stream_batches(filename: str) -> Iterator[Any]:
    """The Arrow record batches of the cache file `filename`, read as a stream (`pa.OSFile`, not memory-mapped: the
    pages of a mapped file that a scan touches would stay in the process's RSS until the mapping goes). Each batch is
    freed once the caller moves on, so a scan over all rows takes memory that does not grow with them."""
    import pyarrow as pa

    with pa.OSFile(filename) as f:
        yield from pa.ipc.open_stream(f)


def _raw_batches(raw: Any) -> Iterator[list[str]]:
    """The raw rows' JSON texts, one Arrow record batch at a time, read as a stream."""
    for cache_file in raw.cache_files:
        for batch in stream_batches(cache_file["filename"]):
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


def tokenized_rows(path: Path, data_cfg: DataConfig, encoder: SampleEncoder, encoder_fp: str) -> str:
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
            raw = raw_rows(path, data_cfg)
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
            try:
                with tqdm(total=len(raw), unit=" examples", desc=f"tokenizing {path.name}") as progress:
                    with ArrowWriter(features=_features(encoder.ranking, encoder.prompt_only), path=str(tmp)) as writer:
                        for out in _encoded_batches(raw, encoder, basic.num_proc or 1):
                            writer.write_batch(out)
                            progress.update(len(out["length"]))
                        writer.finalize()
                os.replace(tmp, cache_file)
            finally:
                tmp.unlink(missing_ok=True)
        return str(cache_file)


def mapped_table(cache_file: str) -> Any:
    """The tokenized table of `cache_file`, memory-mapped (HF datasets): what reading one sample's record uses."""
    import datasets

    return datasets.Dataset.from_file(cache_file)
