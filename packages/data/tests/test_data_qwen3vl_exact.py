"""The `qwen3_vl_nothink` / `qwen3_vl` templates + `qwen2_vl` plugin give exactly HF `Qwen3VLProcessor`'s ids and pixels.

Reference: `Qwen3VLProcessor.apply_chat_template(messages, tokenize=True)` with the
official Qwen3-VL chat templates (tests/data, see its README): the Instruct template
for `qwen3_vl_nothink`, the Thinking template for `qwen3_vl`. The tokenizer is a small
byte-level BPE with Qwen's pre-tokenizer regex and special tokens (conftest), the image
processor a real `Qwen2VLImageProcessor` (16-px patches, merge 2, temporal patch 2).
The conversation has a system prompt, three turns and three images of different
sizes, two of them in one user turn.
"""

from __future__ import annotations

from pathlib import Path

from mmfsdp.data import IGNORE_INDEX, SampleEncoder

DATA = Path(__file__).parent / "data"
SYSTEM = "You are a careful assistant.\nAnswer briefly."
TURNS = [
    ("<image>What is in this picture? Ünïcødé, 12345 and  two spaces.", "A noisy square.  "),
    ("Compare it with these:\n<image><image>\nand tell me which is wider.", "The second one is wider."),
    ("Thanks! Anything else?", "No, that's all.\n"),
]


def _compare(h, processor, cfg, images, template_file, size=None, turns=TURNS):
    return h.compare_qwen_vl_chat(processor, cfg, DATA / template_file, SYSTEM, turns, images, size)


def test_nothink_matches_the_instruct_template(qwen_processor, tmp_path, h, chat_images):
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"})
    encoder, sample = _compare(h, qwen_processor, cfg, chat_images, "qwen3_vl_instruct_chat_template.jinja")
    assert [g[1:] for g in sample["image_grids"]] == [[4, 2], [8, 18], [4, 4]]  # 40x70, 300x120, 64x64 smart-resized to multiples of 32
    end = qwen_processor.token_id("<|im_end|>")
    answers = qwen_processor.encode_texts([a for _, a in TURNS])
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [a + [end] for a in answers]


def test_qwen3_vl_matches_the_thinking_template(qwen_processor, tmp_path, h, chat_images):
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl"})
    _, sample = _compare(h, qwen_processor, cfg, chat_images, "qwen3_vl_thinking_chat_template.jinja")
    end = qwen_processor.token_id("<|im_end|>")
    think = [qwen_processor.token_id("<think>"), *qwen_processor.encode_texts(["\n\n"])[0], qwen_processor.token_id("</think>")]
    history = qwen_processor.encode_texts([a for _, a in TURNS[:-1]])
    last = qwen_processor.encode_texts(["\n\n" + TURNS[-1][1]])[0]
    # Only the last answer carries the (empty) think block, trained with it; earlier answers render plain.
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [a + [end] for a in history] + [think + last + [end]]


def test_qwen3_vl_keeps_the_last_reasoning_and_drops_older_ones(qwen_processor, tmp_path, h, chat_images):
    turns = [(TURNS[0][0], "<think>\nlooking at it\n</think>\n\nA square."), (TURNS[1][0], "Hmm.<think>compare</think>The second."), TURNS[2][:1] + ("<think>done</think>No.",)]
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl"})
    _compare(h, qwen_processor, cfg, chat_images, "qwen3_vl_thinking_chat_template.jinja", turns=turns)


def test_pixel_limits_are_the_smart_resize_bounds(qwen_processor, tmp_path, h, chat_images):
    limits = {"image_max_pixels": 64 * 64, "image_min_pixels": 48 * 48}
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink", **limits})
    _, sample = _compare(h, qwen_processor, cfg, chat_images, "qwen3_vl_instruct_chat_template.jinja", size={"shortest_edge": 48 * 48, "longest_edge": 64 * 64})
    assert all(g[1] * g[2] * 16 * 16 <= 64 * 64 for g in sample["image_grids"])


def test_mask_history_and_train_on_prompt(qwen_processor, tmp_path, h, chat_images):
    base = SampleEncoder(h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}), qwen_processor).encode_row(h.chat_row(SYSTEM, TURNS, chat_images))
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink", "mask_history": True})
    last_only = SampleEncoder(cfg, qwen_processor).encode_row(h.chat_row(SYSTEM, TURNS, chat_images))
    assert last_only["input_ids"] == base["input_ids"]
    assert h.trained_runs(last_only["input_ids"], last_only["labels"]) == h.trained_runs(base["input_ids"], base["labels"])[-1:]
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink", "train_on_prompt": True})
    encoder = SampleEncoder(cfg, qwen_processor)
    everything = encoder.encode_row(h.chat_row(SYSTEM, TURNS, chat_images))
    assert everything["labels"] == [IGNORE_INDEX if t in encoder.plugin.image_token_ids else t for t in base["input_ids"]]


def test_enable_thinking_false_drops_the_reasoning_and_leaves_the_empty_block_untrained(qwen_processor, tmp_path, h, chat_images):
    """LLaMA-Factory's (and MindSpeed-MM's) `enable_thinking: false` on the thinking template: the tokens are those
    of the answer without reasoning (the empty block), and the block is prompt; `qwen3_vl_nothink` ignores it."""
    reasoned = [*TURNS[:-1], (TURNS[-1][0], "<think>\nweighing it\n</think>\n\n" + TURNS[-1][1])]
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl", "enable_thinking": False})
    _, sample = _compare(h, qwen_processor, cfg, chat_images, "qwen3_vl_thinking_chat_template.jinja")  # no reasoning given
    dropped = SampleEncoder(cfg, qwen_processor).encode_row(h.chat_row(SYSTEM, reasoned, chat_images))
    assert dropped["input_ids"] == sample["input_ids"]
    end = qwen_processor.token_id("<|im_end|>")
    history = qwen_processor.encode_texts([a for _, a in TURNS[:-1]])
    last = qwen_processor.encode_texts(["\n\n" + TURNS[-1][1]])[0]
    think_end = qwen_processor.token_id("</think>")
    runs = h.trained_runs(dropped["input_ids"], dropped["labels"])
    assert runs[:-1] == [a + [end] for a in history]
    assert think_end not in runs[-1] and runs[-1][-1] == end
    answer = runs[-1][:-1]  # the last answer, trained after the block's "\n\n"
    assert last[-len(answer):] == answer and qwen_processor.decode(answer).strip() == TURNS[-1][1].strip()
    nothink = {"template": "qwen3_vl_nothink"}
    on = SampleEncoder(h.data_config(qwen_processor.name_or_path, tmp_path, preprocess=nothink), qwen_processor)
    off = SampleEncoder(h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={**nothink, "enable_thinking": False}), qwen_processor)
    assert on.encode_row(h.chat_row(SYSTEM, TURNS, chat_images)) == off.encode_row(h.chat_row(SYSTEM, TURNS, chat_images))
