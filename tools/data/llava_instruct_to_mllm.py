"""Convert LLaVA-Instruct-150K (+ a COCO image directory) to the mllm format mmfsdp reads.

    python tools/data/llava_instruct_to_mllm.py \
        --input data/llava_instruct_150k.json \
        --image-dir data/COCO2017/train2017 \
        --dataset-dir data \
        --output data/mllm_format_llava_instruct_data.json

LLaVA rows look like
`{"id": ..., "image": "000000033471.jpg", "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}]}`;
each becomes
`{"images": ["COCO2017/train2017/000000033471.jpg"], "messages": [{"role": "user", "content": "<image>\\n..."}, {"role": "assistant", "content": "..."}]}`
with image paths relative to `--dataset-dir` (set `data.dataset_param.basic_parameters.dataset_dir`
to the same directory). Texts are copied unchanged; rows the converter cannot map
(unknown speaker, no conversation) are counted and left out; everything else — a
placeholder/image mismatch, a missing image — is left for the loader, which skips and
counts such rows (or use `--check-images` to drop rows whose image file is absent).
Output is a JSON list, or JSONL if the output name ends in `.jsonl`. The last line printed is one JSON object:
`rows` read, `written`, `dropped` (per reason) and `output`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def convert_row(row: dict, image_prefix: str) -> dict | None:
    """One LLaVA row -> one mllm row, or None if it has no usable conversation."""
    conversations = row.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        return None
    messages = []
    for turn in conversations:
        role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            return None
        messages.append({"role": role, "content": turn["value"]})
    image = row.get("image")
    images = [image] if isinstance(image, str) else list(image or [])
    return {"images": [f"{image_prefix}{name}" for name in images], "messages": messages}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert LLaVA-Instruct-150K JSON to mmfsdp's mllm format.")
    parser.add_argument("--input", required=True, help="LLaVA-Instruct JSON file (a list of rows), e.g. data/llava_instruct_150k.json")
    parser.add_argument("--image-dir", required=True, help="directory holding the COCO images the rows name, e.g. data/COCO2017/train2017")
    parser.add_argument("--dataset-dir", default="data", help="directory image paths are written relative to; use the same value as basic_parameters.dataset_dir (default: data)")
    parser.add_argument("--output", required=True, help="output file: .json for a JSON list, .jsonl for one row per line")
    parser.add_argument("--check-images", action="store_true", help="drop rows whose image file does not exist (default: keep them; the loader skips and counts them)")
    parser.add_argument("--max-rows", type=int, default=None, help="convert only the first N rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    image_dir = Path(args.image_dir)
    try:
        prefix = os.path.relpath(image_dir.resolve(), Path(args.dataset_dir).resolve())
    except ValueError:  # different drives on Windows
        prefix = str(image_dir.resolve())
    prefix = "" if prefix == "." else prefix.replace(os.sep, "/") + "/"
    with open(args.input, encoding="utf-8") as f:
        rows = json.load(f)
    if not isinstance(rows, list):
        print(f"error: {args.input} must hold a JSON list of rows", file=sys.stderr)
        return 2
    rows = rows[: args.max_rows]
    out, dropped = [], Counter()
    for row in rows:
        converted = convert_row(row, prefix) if isinstance(row, dict) else None
        if converted is None:
            dropped["no usable conversation"] += 1
            continue
        if args.check_images and not all((Path(args.dataset_dir) / p).is_file() for p in converted["images"]):
            dropped["image file missing"] += 1
            continue
        out.append(converted)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        if output.suffix == ".jsonl":
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in out)
        else:
            json.dump(out, f, ensure_ascii=False)
    os.replace(tmp, output)
    summary = ", ".join(f"{reason}: {n}" for reason, n in dropped.items())
    print(f"wrote {len(out)} of {len(rows)} rows to {output}" + (f" (dropped {summary})" if summary else ""))
    print(json.dumps({"rows": len(rows), "written": len(out), "dropped": dict(dropped), "output": str(output)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
