"""Dataset preparation keeps no Python object per row: its memory does not grow with the rows.

The whole path that `mm-data stats` and the trainer's set-up run — raw rows (JSONL and a JSON list), the tokenizing
pass, the good rows' index, `sample_stats`, `media_kinds`, `vision_token_stats` — runs twice on 500 and twice on
4,000 synthetic rows (text-only, one and two images, bad rows) under `tracemalloc`, with Arrow record batches of 125
rows (HF datasets' default is 1,000; the sizes scale with it). Python's allocations and numpy's are traced (Arrow's
buffers are not; they are one batch at a time, read as a stream, and `tools/bench/data_prep.py` measures the
process's RSS).

Each size's peak is the lower of its two runs: now and then one run also holds a one-off reallocation of Python's
table of interned strings (~7 MiB in a process with torch imported; pathlib interns each path's parts, so the
per-row paths churn it and it is rebuilt every few ten thousand rows), which two runs of a size seldom both hold.

The bound: the larger size's traced peak may exceed the smaller one's by at most `BYTES_PER_ROW` = 32 bytes per
extra row: what is inherently kept per sample — the dataset's int32 (row, length) index, 8 bytes (16 while it grows
by doubling), and `sample_stats`' three int64 arrays, 24 — fits in it; `mm-data stats`' two int32 counts and a
sorted copy for the percentiles, 12, exist only while it runs. Measured (2026-12-05): 2 (JSON list) and -7 (JSONL)
bytes per row (the peak is the tokenizing pass's batch buffers, flat in the rows); with 125-row batches
(2026-12-06) 4.5 (JSON list) and 9 (JSONL) between 500 and 4,000 rows. Before the pass streamed,
`mm-data stats` kept each row's tokens and paths as Python objects: about 3 KB per row; the previous bound was 200.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from mmfsdp.data import build_dataset, prepare_dataset
from mmfsdp.data import json_rows
from mmfsdp.data.cli import vision_token_stats

SIZES = (500, 4_000)
"""Both large enough that both runs hold the same batch-sized buffers at their peak (with `BATCH_ROWS` rows per
batch; at 1,000-row batches the traced peak is flat from about 2,000 rows on)."""
BATCH_ROWS = 125
"""Rows per Arrow record batch of the raw and tokenized files (`datasets.config.DEFAULT_MAX_BATCH_SIZE`)."""
BYTES_PER_ROW = 32


def _rows(num: int) -> list[str]:
    rng = np.random.default_rng(num)
    rows = []
    for i in range(num):
        if i % 100 == 7:
            rows.append('{"messages": []}')  # skipped as empty_conversation
            continue
        images = [f"img/{int(k)}.png" for k in rng.integers(2, size=i % 3)]
        answer = " ".join(rng.choice(["a", "red", "green", "circle", "square"], size=1 + i % 12))
        question = "<image>" * len(images) + "What shape and colour is this?"
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append(json.dumps({"messages": messages, "images": images}))
    return rows


def _prepare(cfg, processor) -> tuple[int, int]:
    """The traced peak (bytes) of preparing `cfg`'s dataset and reading what training and `mm-data stats` read."""
    tracemalloc.start()
    try:
        prepare_dataset(cfg)
        dataset = build_dataset(cfg, processor)
        dataset.sample_stats()
        dataset.media_kinds()
        stats = vision_token_stats(dataset, 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats["num_samples"] == len(dataset) and stats["with_images"] > len(dataset) // 2
    return peak, dataset.num_rows


@pytest.mark.slow  # ~25 CPU-seconds: 18,000 rows tokenized under tracemalloc
def test_preparation_memory_does_not_grow_with_rows(tiny_dir, tiny_processor, tmp_path, h, monkeypatch):
    import datasets

    monkeypatch.setattr(json_rows, "_READ_BYTES", 1 << 14)  # a JSON list is read in several pieces
    monkeypatch.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", BATCH_ROWS)
    for k in range(2):
        h.write_image(tmp_path / "img" / f"{k}.png", 16 + 16 * k, 16, seed=k)
    for kind in ("jsonl", "json"):
        peaks: dict[int, list[int]] = {}
        for run, num in enumerate((20, *SIZES, *SIZES)):  # the first run pays one-time costs (lazy imports, set-up)
            rows = _rows(num)
            path = tmp_path / f"rows_{num}.{kind}"
            path.write_text("\n".join(rows) + "\n" if kind == "jsonl" else "[\n" + ",\n".join(rows) + "\n]\n")
            cache = tmp_path / f"{kind}-{run}"
            cfg = h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path), "cache_dir": str(cache)})
            peak, num_rows = _prepare(cfg, tiny_processor)
            assert num_rows == num
            peaks.setdefault(num, []).append(peak)
        small, large = (min(peaks[num]) for num in SIZES)
        growth = (large - small) / (SIZES[1] - SIZES[0])
        assert growth <= BYTES_PER_ROW, f"{kind}: traced peaks {peaks} grow {growth:.0f} bytes per row"
