"""Peak memory and rows/s of dataset preparation (`mm-data stats`' path) at two sizes: memory must not grow with rows.

    uv run python tools/bench/data_prep.py [--rows 100000 1000000] [--work-dir DIR]
    uv run python tools/bench/data_prep.py --smoke     # the smallest run (CI): 500 and 2,000 rows

Writes the tiny Mistral processor (`examples/tiny/assets`' kind: the synthetic words, Pixtral image settings), four
small shared PNGs and, per size, a JSONL file of the project's row format (`messages` + `images`): 40 % text-only
rows, the rest one or two images of different sizes, 1-3 turns, answers of 1-15 words, and 1 % bad rows (a missing
image, a line that is not JSON) that are skipped and counted. Then, per size, a fresh child process:

1. imports everything and runs the whole path once on 50 rows (so lazy imports and one-time set-up are paid);
2. takes its RSS as the baseline and resets its peak (`/proc/self/clear_refs`; where that is refused, the peak
   since start is used and said so in `peak_reset`);
3. runs what `mm-data stats` runs: `prepare_dataset` (raw rows), `build_dataset` (tokenizing pass, the good rows'
   index), `vision_token_stats`, and what training reads before its first step: `sample_stats`, `media_kinds`;
4. reports `peak_rss_mib`, the process's whole peak RSS (`VmHWM`: imports, torch and the processor included — what
   a user sees), `peak_growth_mib` (`VmHWM` − baseline: what step 3 added) and rows/s of step 3 (file rows, bad ones
   included, per second of wall time, and per CPU second: `rows_per_cpu_s` is the steadier one on a loaded machine).

`rss_ratio_1m_over_100k` is the ratio of the two sizes' whole-process peak RSS (`VmHWM`), larger over smaller
(whatever `--rows` gives; the issue's target is <= 1.2). `growth_ratio` is the same ratio of the growth above the
baseline, and `bytes_per_extra_row` the growth's increase per extra row, (growth_large − growth_small) /
(rows_large − rows_small): what memory still grows with the rows. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _smoke import parse_args

IMAGE_SIZES = ((64, 64), (48, 32), (32, 64), (16, 16))
WARM_ROWS = 50
PROMPTS = ("<image>What shape and colour is this?", "What colour is the banana?", "What is this shape?")
ANSWER_WORDS = ("a", "red", "green", "blue", "yellow", "circle", "square", "triangle", "shape", "and", "colour")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _row(rng: np.random.Generator) -> str:
    """One JSONL line: text-only (40 %) or one/two images, 1-3 turns, answers of 1-15 words; 1 % bad rows."""
    kind = rng.random()
    if kind < 0.005:
        return '{"messages": [{"role": "user", "content": "cut off'  # not JSON: bad_content
    num_images = 0 if kind < 0.4 else (1 if kind < 0.8 else 2)
    images = [f"img/{int(rng.integers(len(IMAGE_SIZES)))}.png" for _ in range(num_images)]
    if kind > 0.995:
        images[-1] = "img/missing.png"  # missing_image
    messages = []
    for turn in range(int(rng.integers(1, 4))):
        prompt = PROMPTS[int(rng.integers(1, len(PROMPTS)))]
        if turn == 0:
            prompt = "<image>" * num_images + prompt.removeprefix("<image>")
        answer = " ".join(ANSWER_WORDS[i] for i in rng.integers(len(ANSWER_WORDS), size=int(rng.integers(1, 16))))
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages, "images": images})


def write_inputs(work: Path, rows: list[int]) -> dict[int, Path]:
    """The processor, the images and one JSONL file per size under `work`; returns {rows: file}."""
    from PIL import Image

    from mmfsdp.data.families.mistral.synthetic import write_tiny_processor

    write_tiny_processor(work / "processor", image_size=64, patch_size=8, spatial_merge_size=1)
    (work / "img").mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(IMAGE_SIZES):
        pixels = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(work / "img" / f"{i}.png")
    files = {}
    for n in sorted({WARM_ROWS, *rows}):
        path = work / f"rows_{n}.jsonl"
        if not path.is_file():
            rng = np.random.default_rng(n)
            with open(path, "w") as f:
                for _ in range(n):
                    f.write(_row(rng) + "\n")
        files[n] = path
    return files


def _config(work: Path, data_file: Path, cache: Path):
    from mmfsdp.config import build
    from mmfsdp.data import DataConfig

    raw = {
        "dataset_param": {
            "preprocess_parameters": {"model_name_or_path": str(work / "processor"), "template": "mistral",
                                      "cutoff_len": 1024},
            "basic_parameters": {"dataset_dir": str(work), "dataset": str(data_file), "cache_dir": str(cache)},
        },
        "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "pixtral"}},
    }
    return build(DataConfig, raw, "data")


def _prepare(data_cfg, processor) -> dict:
    """What `mm-data stats` and the trainer's set-up do with a dataset, up to the first step."""
    from mmfsdp.data.cli import vision_token_stats
    from mmfsdp.data.dataset import build_dataset, prepare_dataset

    prepare_dataset(data_cfg)
    dataset = build_dataset(data_cfg, processor)
    stats = vision_token_stats(dataset, 5)
    dataset.sample_stats()
    dataset.media_kinds()
    return {"num_rows": dataset.num_rows, "num_samples": len(dataset), "bad_rows": dataset.bad_row_counts,
            "with_images": stats["with_images"]}


def child(work: Path, data_file: Path, warm_file: Path, num_rows: int) -> dict:
    """Step 1-4 of the module docstring in this (fresh) process."""
    from mmfsdp.config import get_logger
    from mmfsdp.data import build_processor

    get_logger().setLevel("WARNING")
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    processor = build_processor(_config(work, warm_file, cache / "warm"))
    _prepare(_config(work, warm_file, cache / "warm"), processor)
    data_cfg = _config(work, data_file, cache / "run")
    baseline = _status_mib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    start, cpu_start = time.perf_counter(), time.process_time()
    result = _prepare(data_cfg, processor)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert result["num_rows"] == num_rows, (result, num_rows)
    peak = _status_mib("VmHWM")
    return {**result, "baseline_rss_mib": round(baseline, 1), "peak_rss_mib": round(peak, 1),
            "peak_growth_mib": round(peak - baseline, 1),
            "end_rss_file_mib": round(_status_mib("RssFile"), 1), "peak_reset": reset, "seconds": round(seconds, 2),
            "rows_per_s": round(num_rows / seconds, 1), "rows_per_cpu_s": round(num_rows / cpu_seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs=2, default=[100_000, 1_000_000], help="the two sizes (rows)")
    parser.add_argument("--work-dir", default=None, help="where inputs and caches go (default: a temporary directory)")
    parser.add_argument("--child", nargs=3, metavar=("WORK", "FILE", "ROWS"), help=argparse.SUPPRESS)
    args = parse_args(parser, argv, rows=[500, 2_000])
    if args.child:
        work, data_file, num_rows = Path(args.child[0]), Path(args.child[1]), int(args.child[2])
        print(json.dumps(child(work, data_file, work / f"rows_{WARM_ROWS}.jsonl", num_rows)))
        return
    small, large = sorted(args.rows)
    with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
        work = Path(args.work_dir or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        files = write_inputs(work, [small, large])
        runs = {}
        for n in (small, large):
            command = [sys.executable, __file__, "--child", str(work), str(files[n]), str(n)]
            run = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if run.returncode != 0:
                raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{run.stderr[-4000:]}")
            runs[n] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{n} rows: {runs[n]}", flush=True)
    print(json.dumps({
        "rows": [small, large],
        "peak_rss_mib": [runs[small]["peak_rss_mib"], runs[large]["peak_rss_mib"]],
        "peak_growth_mib": [runs[small]["peak_growth_mib"], runs[large]["peak_growth_mib"]],
        "rows_per_s": [runs[small]["rows_per_s"], runs[large]["rows_per_s"]],
        "rows_per_cpu_s": [runs[small]["rows_per_cpu_s"], runs[large]["rows_per_cpu_s"]],
        "load_avg": Path("/proc/loadavg").read_text().split()[:3],
        "rss_ratio_1m_over_100k": round(runs[large]["peak_rss_mib"] / runs[small]["peak_rss_mib"], 3),
        "growth_ratio": round(runs[large]["peak_growth_mib"] / max(runs[small]["peak_growth_mib"], 1.0), 3),
        "bytes_per_extra_row": round(
            (runs[large]["peak_growth_mib"] - runs[small]["peak_growth_mib"]) * 2**20 / (large - small), 1
        ),
        "runs": {str(n): runs[n] for n in (small, large)},
    }))


if __name__ == "__main__":
    main()
