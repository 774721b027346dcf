"""The `qwen3_5` template + `qwen3_vl` plugin give exactly HF `Qwen3VLProcessor`'s ids and pixels with the official
Qwen3.5 chat template.

Reference: `Qwen3VLProcessor.apply_chat_template(messages, tokenize=True)` (Qwen3.5 checkpoints ship Qwen3-VL's
processor) with the official Qwen3.5 `chat_template.jinja` (tests/data, see its README). The tokenizer is the small
byte-level BPE with Qwen's regex and special tokens of the conftest, the image processor a real
`Qwen2VLImageProcessor`. The conversation has a system prompt, three turns and three images of different sizes,
and whitespace around the system prompt, the user messages, the answers and the reasoning, which the official
template trims (Qwen3-VL's does not).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from mmfsdp.data import IGNORE_INDEX, SampleEncoder

DATA = Path(__file__).parent / "data"
TEMPLATE = "qwen3_5_chat_template.jinja"
SYSTEM = "  You are a careful assistant.\nAnswer briefly.\n"
TURNS = [
    (" <image>What is in this picture? Ünïcødé, 12345 and  two spaces.\n", "A noisy square.  "),
    ("Compare it with these:\n<image><image>\nand tell me which is wider. ", "\n The second one is wider."),
    ("\tThanks! Anything else?", "No, that's all.\n"),
]
IMAGE_SIZES = [(40, 70), (300, 120), (64, 64)]  # (width, height)


@pytest.fixture(scope="module")
def images(tmp_path_factory, h) -> list[str]:
    out = tmp_path_factory.mktemp("qwen3_5_images")
    return [h.write_image(out / f"img{i}.png", w, hh, seed=i) for i, (w, hh) in enumerate(IMAGE_SIZES)]


def _row(images: list[str], turns=TURNS) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": images}


def _hf_messages(images: list[str], turns=TURNS) -> list[dict]:
    """The same conversation in HF's format: content lists with image items where the placeholders are."""
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    image_iter = iter(images)
    for user, assistant in turns:
        content = []
        for j, piece in enumerate(user.split("<image>")):
            if j:
                content.append({"type": "image", "image": Image.open(next(image_iter)).convert("RGB")})
            if piece:
                content.append({"type": "text", "text": piece})
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": assistant}]},
        ]
    return messages


def _reference(processor, images, turns=TURNS):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    hf = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(processor.name_or_path),
        tokenizer=processor.tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=(DATA / TEMPLATE).read_text(),
    )
    return hf.apply_chat_template(_hf_messages(images, turns), tokenize=True, return_dict=True, return_tensors="pt")


def _trained_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels):
        trained = label != IGNORE_INDEX
        if trained:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = trained
    return runs


def _compare(processor, cfg, images, turns=TURNS):
    encoder = SampleEncoder(cfg, processor)
    sample = encoder.encode_row(_row(images, turns))
    reference = _reference(processor, images, turns)
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    pixels = encoder.plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]])
    assert torch.equal(pixels["image_grid_thw"], reference["image_grid_thw"])
    assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    token_types = encoder.plugin.token_inputs(torch.tensor(sample["input_ids"]))["mm_token_type_ids"]
    assert torch.equal(token_types, torch.as_tensor(reference["mm_token_type_ids"][0]).long())
    return sample


def test_qwen3_5_matches_the_official_template(qwen_processor, tmp_path, h, images):
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5"})
    sample = _compare(qwen_processor, cfg, images)
    end = qwen_processor.token_id("<|im_end|>")
    think = [qwen_processor.token_id("<think>"), *qwen_processor.encode_texts(["\n\n"])[0]]
    think.append(qwen_processor.token_id("</think>"))
    history = qwen_processor.encode_texts([a.strip() for _, a in TURNS[:-1]])
    last = qwen_processor.encode_texts(["\n\n" + TURNS[-1][1].strip()])[0]
    # Only the last answer carries the (empty) think block, trained with it; earlier answers render plain, trimmed.
    assert _trained_runs(sample["input_ids"], sample["labels"]) == [a + [end] for a in history] + [think + last + [end]]


def test_qwen3_5_keeps_the_last_reasoning_trimmed_and_drops_older_ones(qwen_processor, tmp_path, h, images):
    turns = [
        (TURNS[0][0], " <think>\nlooking at it\n</think>\n\nA square."),
        (TURNS[1][0], "Hmm.<think>compare</think>The second."),
        (TURNS[2][0], "<think>\n  done, with spaces \n\n</think>\n\n No. "),
    ]
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5"})
    sample = _compare(qwen_processor, cfg, images, turns=turns)
    last = _trained_runs(sample["input_ids"], sample["labels"])[-1]
    assert qwen_processor.decode(last).endswith("<think>\ndone, with spaces\n</think>\n\n No.<|im_end|>")


def test_enable_thinking_false_drops_the_reasoning_and_leaves_the_empty_block_untrained(
    qwen_processor, tmp_path, h, images
):
    """The tokens are the official template's for the answers without reasoning; the empty block is prompt."""
    reasoned = [*TURNS[:-1], (TURNS[-1][0], "<think>\nweighing it\n</think>\n\n" + TURNS[-1][1])]
    cfg = h.data_config(
        qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5", "enable_thinking": False}
    )
    sample = _compare(qwen_processor, cfg, images)
    dropped = SampleEncoder(cfg, qwen_processor).encode_row(_row(images, reasoned))
    assert dropped["input_ids"] == sample["input_ids"]
    end, think_end = qwen_processor.token_id("<|im_end|>"), qwen_processor.token_id("</think>")
    runs = _trained_runs(dropped["input_ids"], dropped["labels"])
    assert runs[:-1] == [a + [end] for a in qwen_processor.encode_texts([a.strip() for _, a in TURNS[:-1]])]
    assert think_end not in runs[-1] and runs[-1][-1] == end
    assert qwen_processor.decode(runs[-1][:-1]).strip() == TURNS[-1][1].strip()
