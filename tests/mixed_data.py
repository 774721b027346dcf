"""Mixed test data as real SFT mixes are: rows with several images of different sizes and text-only rows.

`make_mixed_dataset` writes `make_varlen_dataset`'s rows (1–2 images of varied sizes, 1–3 turns, answers
of varied length) and turns every `text_only_every`-th row into a text-only row (its `<image>` placeholders
and `images` removed), so the share of text-only rows is exact and the same for train and eval.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmfsdp.data.synthetic import make_varlen_dataset


def make_mixed_dataset(
    out_dir: Path, *, num_train: int, num_eval: int, seed: int, text_only_every: int = 2, **varlen
) -> Path:
    """The dataset directory (`train.jsonl`, `eval.jsonl`, `images/`); rows with `index % text_only_every == 1`
    (and every row when `text_only_every` is 1) have no image. `varlen`: more `make_varlen_dataset` arguments."""
    make_varlen_dataset(
        out_dir, num_train=num_train, num_eval=num_eval, seed=seed, min_images=1, max_images=2, **varlen
    )
    for split in ("train", "eval"):
        path = out_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for index, row in enumerate(rows):
            if text_only_every == 1 or index % text_only_every == 1:
                row["images"] = []
                for message in row["messages"]:
                    message["content"] = message["content"].replace("<image>", "")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_dir


def text_only_share(dataset_dir: Path, split: str = "train") -> float:
    rows = [json.loads(line) for line in (dataset_dir / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    return sum(not row.get("images") for row in rows) / len(rows)
