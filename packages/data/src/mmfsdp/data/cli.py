"""`mm-data`: look at the data exactly as the model will see it.

    mm-data inspect CONFIG.yaml [data.key.path=value ...] --index N [--split eval] [--json]
    mm-data stats CONFIG.yaml [data.key.path=value ...] [--split eval] [--top K] [--json]

Reads the whole YAML but uses only its `data:` section; dotted overrides apply first
and may stand before or after the options.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import logging
import sys
from typing import Any

import numpy as np

from mmfsdp.config import ConfigError, build, get_logger, load_translated

from mmfsdp.data.errors import format_counts

__all__ = ["main", "vision_token_stats"]

TRAIN_OPEN, TRAIN_CLOSE = "⟦", "⟧"


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `mm-data` parser and its subparsers by name (each parsed on its own, so overrides may follow options)."""
    parser = argparse.ArgumentParser(
        prog="mm-data",
        description="Inspect mmfsdp training data. `mm-data COMMAND -h` explains a command's arguments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    inspect = sub.add_parser(
        "inspect",
        help="show one preprocessed sample",
        description=(
            "Show one sample exactly as the model will see it: the decoded text with the trained "
            f"tokens between {TRAIN_OPEN} and {TRAIN_CLOSE}, each image, video or audio block shown as its grid, the "
            "token count, each image's grid and processed size, each video's sampled frame times, grid and token "
            "count, each audio clip's seconds, feature frames and tokens, and the effective media settings with where each came from (config, model directory "
            "file, transformers default). Builds (or reuses) the tokenized cache. "
            "Overrides may come before or after the options."
        ),
    )
    inspect.add_argument("config", help="training YAML file; only its data: section is used")
    inspect.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied to the YAML first, e.g. data.dataset_param.preprocess_parameters.cutoff_len=2048")
    inspect.add_argument("--index", type=int, default=0, help="sample index after bad rows are removed (default 0); negative counts from the end")
    inspect.add_argument("--split", choices=("train", "eval"), default="train", help="which dataset: train = basic_parameters.dataset, eval = basic_parameters.eval_dataset (default train)")
    inspect.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with input_ids, labels, image_sizes (and image and video grids, frame times, "
        "source file and row) instead of text",
    )
    stats = sub.add_parser(
        "stats",
        help="vision and audio tokens per sample over a dataset, and the worst rows",
        description=(
            "The distribution of vision tokens per sample (every image and video block: pads, timestamps, "
            "start/end), of audio tokens and seconds (when the data has audio) and of all tokens per sample over a "
            "whole dataset, from the tokenized cache (nothing is decoded), with the samples of the most vision and "
            "audio tokens by source file and row: the rows to look at "
            "before a run runs out of memory. Overrides may come before or after the options."
        ),
    )
    stats.add_argument("config", help="training YAML file; only its data: section is used")
    stats.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied to the YAML first")
    stats.add_argument("--split", choices=("train", "eval"), default="train", help="which dataset (default train)")
    stats.add_argument("--top", type=int, default=5, help="how many of the worst samples to list (default 5)")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser, {"inspect": inspect, "stats": stats}


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; `inspect`'s arguments are parsed intermixed, so `CONFIG --index 0 KEY=VALUE` keeps the override.

    (argparse's intermixed parsing does not support subparsers, so the subcommand's own parser takes its arguments.)
    """
    parser, commands = _parsers()
    if argv and argv[0] in commands:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def _render(
    ids: list[int], labels: list[int], processor: Any, plugin: Any, grids: list[tuple[int, ...]],
    video_grids: list[tuple[int, ...]] = (), audio_grids: list[tuple[int, ...]] = (),
) -> str:
    """Decoded text; each image block collapses to `<image LABEL>`, each video block to `<video LABEL>`, each audio
    block to `<audio LABEL>` (the plugin's labels of their grids); trained runs are bracketed."""
    out: list[str] = []
    run: list[int] = []
    run_trained = False
    blocks = iter(grids)
    videos = iter(video_grids)
    next_video = next(videos, None)
    audios = iter(audio_grids)
    next_audio = next(audios, None)

    def flush() -> None:
        if run:
            text = processor.decode(run)
            out.append(f"{TRAIN_OPEN}{text}{TRAIN_CLOSE}" if run_trained else text)
            run.clear()

    i = 0
    while i < len(ids):
        audio_block = plugin.audio_tokens(next_audio) if next_audio is not None else None
        if audio_block is not None and ids[i : i + len(audio_block)] == audio_block:
            flush()
            out.append(f"<audio {plugin.audio_label(next_audio)}>")
            i += len(audio_block)
            next_audio = next(audios, None)
            continue
        if next_video is not None and ids[i : i + 1] == plugin.video_tokens(next_video)[:1]:
            tokens = plugin.video_tokens(next_video)
            if ids[i : i + len(tokens)] == tokens:  # media blocks come in text order; a video's starts like an image's
                flush()
                out.append(f"<video {plugin.video_label(next_video)}>")
                i += len(tokens)
                next_video = next(videos, None)
                continue
        if ids[i] in plugin.image_token_ids:
            flush()
            grid = next(blocks)
            out.append(f"<image {plugin.label(grid)}>")
            i += len(plugin.image_tokens(grid))
            continue
        trained = labels[i] != -100
        if trained != run_trained:
            flush()
            run_trained = trained
        run.append(ids[i])
        i += 1
    flush()
    return "".join(out)


def _dataset(args: argparse.Namespace):
    """The dataset of `args.split` as the config and overrides describe it (its tokenized cache built or reused)."""
    from mmfsdp.data.config import DataConfig
    from mmfsdp.data.dataset import build_dataset, prepare_dataset
    from mmfsdp.data.build import build_processor

    translated = load_translated(DataConfig, args.config, args.overrides, section="data")
    if translated.warning() is not None:  # stderr: with --json, stdout holds only the JSON
        print(f"mm-data: warning: {translated.warning()}", file=sys.stderr)
    data_cfg = build(DataConfig, translated.data, "data")
    prepare_dataset(data_cfg)
    processor = build_processor(data_cfg)
    return build_dataset(data_cfg, processor, args.split)


def _summary(values: np.ndarray) -> dict[str, float]:
    """min, mean, p50, p90, p99 (nearest rank) and max of `values`; {} when there are none. Integer counts stay
    integers; other values are rounded to two decimals."""
    if not len(values):
        return {}
    ordered = np.sort(values)
    exact = np.issubdtype(ordered.dtype, np.integer)
    value = (lambda v: int(v)) if exact else (lambda v: round(float(v), 2))  # noqa: E731
    rank = lambda q: value(ordered[min(len(ordered) - 1, max(0, -(-q * len(ordered) // 100) - 1))])  # noqa: E731
    total = int(ordered.sum()) if exact else float(ordered.sum(dtype=np.float64))
    return {"min": value(ordered[0]), "mean": round(total / len(ordered), 2), "p50": rank(50),
            "p90": rank(90), "p99": rank(99), "max": value(ordered[-1])}


def vision_token_stats(dataset: Any, top: int) -> dict[str, Any]:
    """Vision tokens (the blocks of every image and video grid, as the plugin writes them), audio tokens (the blocks
    of every audio clip) and seconds, and all tokens per sample over `dataset`, from its stored grids and lengths;
    percentiles by nearest rank, and the `top` samples of the most vision and audio tokens (ties: the earlier sample
    first) with their source file and row.

    One pass over `dataset.media_grids()`: per sample it keeps three int32 counts (vision, video and audio tokens)
    and a float32 (audio seconds), for the percentiles, and `dataset.lengths`; the `top` samples are kept in a heap
    during the pass."""
    plugin = dataset.encoder.plugin
    image_block = functools.lru_cache(maxsize=65536)(lambda grid: len(plugin.image_tokens(grid)))
    video_block = functools.lru_cache(maxsize=65536)(lambda grid: len(plugin.video_tokens(grid)))
    audio_block = functools.lru_cache(maxsize=65536)(lambda grid: len(plugin.audio_tokens(grid)))
    num = len(dataset)
    vision, video_tokens, audio_tokens = (np.zeros(num, dtype=np.int32) for _ in range(3))
    seconds = np.zeros(num, dtype=np.float32)
    with_images = with_videos = with_audio = 0
    best: list[tuple[Any, ...]] = []  # ((vision + audio, -index), image, video, audio, #images, #videos, #audios)
    for index, (image_grids, video_grids, audio_grids) in enumerate(dataset.media_grids()):
        image = sum(image_block(tuple(g)) for g in image_grids)
        video = sum(video_block(tuple(g)) for g in video_grids)
        audio = sum(audio_block(tuple(g)) for g in audio_grids)
        vision[index], video_tokens[index], audio_tokens[index] = image + video, video, audio
        seconds[index] = sum(plugin.audio_seconds(tuple(g)) for g in audio_grids)
        with_images, with_videos = with_images + bool(image_grids), with_videos + bool(video_grids)
        with_audio += bool(audio_grids)
        counts = map(len, (image_grids, video_grids, audio_grids))
        entry = ((image + video + audio, -index), image, video, audio, *counts)
        if len(best) < top:
            heapq.heappush(best, entry)
        elif top and entry[0] > best[0][0]:
            heapq.heapreplace(best, entry)
    tokens = dataset.lengths
    worst = []
    for (_, neg_index), image, video, audio, images, videos, audios in sorted(best, reverse=True):
        index = -neg_index
        source, row = dataset.location(index)
        worst.append({
            "index": index, "source": source, "row": row, "vision_tokens": image + video,
            "image_tokens": image, "video_tokens": video, "audio_tokens": audio, "audio_seconds": float(seconds[index]),
            "num_tokens": int(tokens[index]), "images": images, "videos": videos, "audios": audios,
        })
    return {
        "num_samples": num,
        "with_images": with_images,
        "with_videos": with_videos,
        "with_audio": with_audio,
        "vision_tokens": _summary(vision),
        "video_tokens": _summary(video_tokens),
        "audio_tokens": _summary(audio_tokens),
        "audio_seconds": _summary(seconds),
        "num_tokens": _summary(tokens),
        "worst": worst,
    }


def _stats(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise ConfigError("--top", f"must be >= 0, got {args.top}")
    dataset = _dataset(args)
    stats = vision_token_stats(dataset, args.top)
    rows = {"pairs": dataset.is_preference, "num_rows": dataset.num_rows, "bad_rows": dataset.bad_row_counts}
    if args.json:
        print(json.dumps({"split": args.split, **stats, **rows}))
        return 0
    fmt = lambda d: ", ".join(f"{k} {v:g}" for k, v in d.items()) or "none"  # noqa: E731
    unit = "pair" if dataset.is_preference else "sample"
    bad = dataset.num_rows - stats["num_samples"]
    print(
        f"{stats['num_samples']} {unit}s ({args.split}): {stats['with_images']} with images, "
        f"{stats['with_videos']} with videos, {stats['with_audio']} with audio; cutoff_len {dataset.encoder.cutoff_len}"
    )
    if bad:
        what = "pairs" if dataset.is_preference else "rows"
        print(f"bad {what} skipped: {bad} of {dataset.num_rows} rows ({format_counts(dataset.bad_row_counts)})")
    if dataset.is_preference:
        print("per pair: vision tokens of the prompt (each of its two sequences holds them); tokens of both sequences")
    print(f"vision tokens per {unit}: {fmt(stats['vision_tokens'])}")
    print(f"video tokens per {unit}:  {fmt(stats['video_tokens'])}")
    if stats["with_audio"]:
        print(f"audio tokens per {unit}:  {fmt(stats['audio_tokens'])}")
        print(f"audio seconds per {unit}: {fmt(stats['audio_seconds'])}")
    print(f"tokens per {unit}:        {fmt(stats['num_tokens'])}")
    media = "vision and audio" if stats["with_audio"] else "vision"
    if stats["worst"]:
        print(f"most {media} tokens (top {len(stats['worst'])}):")
    for w in stats["worst"]:
        audio = f", {w['audios']} audios: {w['audio_tokens']} ({w['audio_seconds']:.1f} s)" if w["audios"] else ""
        print(
            f"  {unit} {w['index']}: {w['source']} row {w['row']}: {w['vision_tokens']} vision tokens "
            f"({w['images']} images: {w['image_tokens']}, {w['videos']} videos: {w['video_tokens']}{audio}) "
            f"of {w['num_tokens']}"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    dataset = _dataset(args)
    if not -len(dataset) <= args.index < len(dataset):
        raise ConfigError("--index", f"{args.index} is out of range: the {args.split} dataset has {len(dataset)} samples")
    index = args.index % len(dataset)
    record = dataset.record(index)
    item = dataset[index]
    source, row = dataset.location(index)
    ids, labels = list(record["input_ids"]), list(record["labels"])
    sequences = {"": (ids, labels)}
    if dataset.is_preference:
        prompt = record["prompt_length"]
        rejected = (ids[:prompt] + list(record["rejected_ids"]), labels[:prompt] + list(record["rejected_labels"]))
        sequences = {"chosen": (ids, labels), "rejected": rejected}
        item = item.get("chosen", item)
    image_sizes = item["image_sizes"].tolist() if "image_sizes" in item else []
    plugin = dataset.encoder.plugin
    if args.json:
        print(
            json.dumps(
                {
                    "index": index,
                    "source": source,
                    "row": row,
                    "num_tokens": len(ids),
                    "input_ids": ids,
                    "labels": labels,
                    **(
                        {"pair": True, "rejected_input_ids": sequences["rejected"][0],
                         "rejected_labels": sequences["rejected"][1], "prompt_length": record["prompt_length"]}
                        if dataset.is_preference else {}
                    ),
                    "image_sizes": image_sizes,
                    "image_grids": record["image_grids"],
                    "images": record["images"],
                    "video_grids": record["video_grids"],
                    "videos": record["videos"],
                    "video_frame_times": [plugin.frame_times(tuple(g)) for g in record["video_grids"]],
                    "audio_grids": record["audio_grids"],
                    "audios": record["audios"],
                    "audio_seconds": [plugin.audio_seconds(tuple(g)) for g in record["audio_grids"]],
                    "media_settings": {s.key: {"value": s.value, "source": s.source} for s in plugin.media_settings()},
                    **({"bad_reason": item["bad_reason"], "bad_detail": item["bad_detail"]} if "bad_reason" in item else {}),
                }
            )
        )
        return 0
    unit = "pair" if dataset.is_preference else "sample"
    print(f"{unit} {index} of {len(dataset)} ({args.split}): {source} row {row}")
    for name, (seq_ids, seq_labels) in sequences.items():
        trained = sum(1 for t in seq_labels if t != -100)
        what = f"{name} tokens" if name else "tokens"
        print(f"{what}: {len(seq_ids)} (trained: {trained}, cutoff_len: {dataset.encoder.cutoff_len})")
    if "bad_reason" in item:
        print(f"media: cannot be loaded: {item['bad_reason']}: {item['bad_detail']}")
    grids = [tuple(g) for g in record["image_grids"]]
    for k, (path, grid) in enumerate(zip(record["images"], grids)):
        size = f", processed to {image_sizes[k][0]}x{image_sizes[k][1]} px" if image_sizes else ""
        print(f"image {k}: {path}: {plugin.describe(grid)}{size}")
    video_grids = [tuple(g) for g in record["video_grids"]]
    for k, (path, grid) in enumerate(zip(record["videos"], video_grids)):
        print(f"video {k}: {path}: {plugin.describe_video(grid)}")
    audio_grids = [tuple(g) for g in record["audio_grids"]]
    for k, (path, grid) in enumerate(zip(record["audios"], audio_grids)):
        print(f"audio {k}: {path}: {plugin.describe_audio(grid)}")
    print("media settings (value, and where it came from):")
    for setting in plugin.media_settings():
        print(f"  {setting}")
    for name, (seq_ids, seq_labels) in sequences.items():
        print(f"{name + ' ' if name else ''}text (trained tokens between {TRAIN_OPEN} {TRAIN_CLOSE}):")
        print(_render(seq_ids, seq_labels, dataset.processor, plugin, grids, video_grids, audio_grids))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from mmfsdp.data.errors import DataError

    logger = get_logger()
    level = logger.level
    if args.json:
        logger.setLevel(logging.WARNING)  # keep stdout pure JSON (the log handler writes to stdout)
    try:
        return _stats(args) if args.command == "stats" else _inspect(args)
    except (ConfigError, DataError) as err:
        print(f"mm-data: error: {err}", file=sys.stderr)
        return 2
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
