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
            f"tokens between {TRAIN_OPEN} and {TRAIN_CLOSE}, each image or video block shown as its grid, the token "
            "count, each image's grid and processed size, each video's sampled frame times, grid and token "
            "count, and the effective image and video settings with where each came from (config, model directory "
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
        help="vision tokens per sample over a dataset, and the worst rows",
        description=(
            "The distribution of vision tokens per sample (every image and video block: pads, timestamps, "
            "start/end) and of all tokens per sample over a whole dataset, from the tokenized cache (no pixel is "
            "decoded), with the samples of the most vision tokens by source file and row: the rows to look at "
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
    video_grids: list[tuple[int, ...]] = (),
) -> str:
    """Decoded text; each image block collapses to `<image LABEL>`, each video block to `<video LABEL>` (the plugin's
    labels of their grids); trained runs are bracketed."""
    out: list[str] = []
    run: list[int] = []
    run_trained = False
    blocks = iter(grids)
    videos = iter(video_grids)
    next_video = next(videos, None)

    def flush() -> None:
        if run:
            text = processor.decode(run)
            out.append(f"{TRAIN_OPEN}{text}{TRAIN_CLOSE}" if run_trained else text)
            run.clear()

    i = 0
    while i < len(ids):
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
    """min, mean, p50, p90, p99 (nearest rank) and max of `values`; {} when there are none."""
    if not len(values):
        return {}
    ordered = np.sort(values)
    rank = lambda q: int(ordered[min(len(ordered) - 1, max(0, -(-q * len(ordered) // 100) - 1))])  # noqa: E731
    return {"min": int(ordered[0]), "mean": round(int(ordered.sum()) / len(ordered), 2), "p50": rank(50),
            "p90": rank(90), "p99": rank(99), "max": int(ordered[-1])}


def vision_token_stats(dataset: Any, top: int) -> dict[str, Any]:
    """Vision tokens (the blocks of every image and video grid, as the plugin writes them) and all tokens per sample
    over `dataset`, from its stored grids and lengths; percentiles by nearest rank, and the `top` samples of the most
    vision tokens (ties: the earlier sample first) with their source file and row.

    One pass over `dataset.media_grids()`: per sample it keeps two int32 counts (vision and video tokens, for the
    percentiles) and `dataset.lengths`; the `top` samples are kept in a heap during the pass."""
    plugin = dataset.encoder.plugin
    image_block = functools.lru_cache(maxsize=65536)(lambda grid: len(plugin.image_tokens(grid)))
    video_block = functools.lru_cache(maxsize=65536)(lambda grid: len(plugin.video_tokens(grid)))
    num = len(dataset)
    vision, video_tokens = np.zeros(num, dtype=np.int32), np.zeros(num, dtype=np.int32)
    with_images = with_videos = 0
    best: list[tuple[tuple[int, int], int, int, int, int]] = []  # ((vision, -index), image, video, #images, #videos)
    for index, (image_grids, video_grids) in enumerate(dataset.media_grids()):
        image = sum(image_block(tuple(g)) for g in image_grids)
        video = sum(video_block(tuple(g)) for g in video_grids)
        vision[index], video_tokens[index] = image + video, video
        with_images, with_videos = with_images + bool(image_grids), with_videos + bool(video_grids)
        entry = ((image + video, -index), image, video, len(image_grids), len(video_grids))
        if len(best) < top:
            heapq.heappush(best, entry)
        elif top and entry[0] > best[0][0]:
            heapq.heapreplace(best, entry)
    tokens = dataset.lengths
    worst = []
    for (vision_count, neg_index), image, video, images, videos in sorted(best, reverse=True):
        index = -neg_index
        source, row = dataset.location(index)
        worst.append({
            "index": index, "source": source, "row": row, "vision_tokens": vision_count,
            "image_tokens": image, "video_tokens": video,
            "num_tokens": int(tokens[index]), "images": images, "videos": videos,
        })
    return {
        "num_samples": num,
        "with_images": with_images,
        "with_videos": with_videos,
        "vision_tokens": _summary(vision),
        "video_tokens": _summary(video_tokens),
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
        f"{stats['with_videos']} with videos; cutoff_len {dataset.encoder.cutoff_len}"
    )
    if bad:
        what = "pairs" if dataset.is_preference else "rows"
        print(f"bad {what} skipped: {bad} of {dataset.num_rows} rows ({format_counts(dataset.bad_row_counts)})")
    if dataset.is_preference:
        print("per pair: vision tokens of the prompt (each of its two sequences holds them); tokens of both sequences")
    print(f"vision tokens per {unit}: {fmt(stats['vision_tokens'])}")
    print(f"video tokens per {unit}:  {fmt(stats['video_tokens'])}")
    print(f"tokens per {unit}:        {fmt(stats['num_tokens'])}")
    if stats["worst"]:
        print(f"most vision tokens (top {len(stats['worst'])}):")
    for w in stats["worst"]:
        print(
            f"  {unit} {w['index']}: {w['source']} row {w['row']}: {w['vision_tokens']} vision tokens "
            f"({w['images']} images: {w['image_tokens']}, {w['videos']} videos: {w['video_tokens']}) "
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
    print("media settings (value, and where it came from):")
    for setting in plugin.media_settings():
        print(f"  {setting}")
    for name, (seq_ids, seq_labels) in sequences.items():
        print(f"{name + ' ' if name else ''}text (trained tokens between {TRAIN_OPEN} {TRAIN_CLOSE}):")
        print(_render(seq_ids, seq_labels, dataset.processor, plugin, grids, video_grids))
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
