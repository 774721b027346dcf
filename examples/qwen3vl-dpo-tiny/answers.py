"""Generate the answers of an HF export on the held-out shapes and count which part of each answer is wrong.

    uv run python examples/qwen3vl-dpo-tiny/answers.py outputs/qwen3vl-dpo-tiny/sft/ckpt/hf/iter_0000200

One process, greedy decoding (`generate`, up to 8 new tokens) of each held-out question of the pair data, the prompt
rendered as the `qwen3_vl_nothink` template renders it for training. An answer is correct when it equals the chosen
answer; a wrong one is counted as a wrong colour, a wrong shape, both, or something else. The share correct is the
greedy answers' accuracy (the trainer's `eval.json` `accuracy` counts the same thing by teacher forcing, in another
computation; the README says by how much the two have differed). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

from mmfsdp.data.synthetic import COLOURS, SHAPES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="an HF export (<training.save>/hf/iter_N)")
    parser.add_argument(
        "--data",
        default=str(ROOT / "outputs/qwen3vl-dpo-tiny/pair-data"),
        help="the pair data",
    )
    parser.add_argument(
        "--assets",
        default=str(ROOT / "examples/qwen3vl-tiny/assets"),
        help="tokenizer, processor",
    )
    parser.add_argument("--limit", type=int, default=256, help="the first N held-out rows")
    return parser.parse_args(argv)


def classify(answer: str, truth: str) -> str:
    """`correct`, `colour`, `shape`, `both` (which part is wrong) or `other` (not `a <colour> <shape>`)."""
    if answer == truth:
        return "correct"
    words, true_words = answer.split(), truth.split()
    if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
        return "other"
    colour_wrong, shape_wrong = words[1] != true_words[1], words[2] != true_words[2]
    return "both" if colour_wrong and shape_wrong else "colour" if colour_wrong else "shape"


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.assets)
    image_processor = AutoImageProcessor.from_pretrained(args.assets)
    model = Qwen3VLForConditionalGeneration.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    merge = image_processor.merge_size**2
    data = Path(args.data)
    rows = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()][: args.limit]
    counts = {"correct": 0, "colour": 0, "shape": 0, "both": 0, "other": 0}
    for row in rows:
        question, truth = row["messages"][0]["content"], row["messages"][1]["content"]
        image = Image.open(data / row["images"][0]).convert("RGB")
        pixels = image_processor(images=[image], return_tensors="pt")
        num_image_tokens = int(pixels["image_grid_thw"].prod()) // merge
        block = "<|vision_start|>" + "<|image_pad|>" * num_image_tokens + "<|vision_end|>"
        prompt = f"<|im_start|>user\n{question.replace('<image>', block)}<|im_end|>\n<|im_start|>assistant\n"
        input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"], max_new_tokens=8, do_sample=False,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        answer = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
        counts[classify(answer, truth)] += 1
    result = {
        "model_dir": args.model_dir,
        "num_samples": len(rows),
        "accuracy": counts["correct"] / len(rows),
    }
    print(json.dumps({**result, "wrong": {k: v for k, v in counts.items() if k != "correct"}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
