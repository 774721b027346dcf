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

from mmfsdp.data import SampleEncoder

DATA = Path(__file__).parent / "data"
TEMPLATE = "qwen3_5_chat_template.jinja"
SYSTEM = "  You are a careful assistant.\nAnswer briefly.\n"
TURNS = [
    (" <image>What is in this picture? Ünïcødé, 12345 and  two spaces.\n", "A noisy square.  "),
    ("Compare it with these:\n<image><image>\nand tell me which is wider. ", "\n The second one is wider."),
    ("\tThanks! Anything else?", "No, that's all.\n"),
]


def _compare(h, processor, cfg, images, turns=TURNS):
    return h.compare_qwen_vl_chat(processor, cfg, DATA / TEMPLATE, SYSTEM, turns, images)[1]


def test_qwen3_5_matches_the_official_template(qwen_processor, tmp_path, h, chat_images):
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5"})
    sample = _compare(h, qwen_processor, cfg, chat_images)
    end = qwen_processor.token_id("<|im_end|>")
    think = [qwen_processor.token_id("<think>"), *qwen_processor.encode_texts(["\n\n"])[0]]
    think.append(qwen_processor.token_id("</think>"))
    history = qwen_processor.encode_texts([a.strip() for _, a in TURNS[:-1]])
    last = qwen_processor.encode_texts(["\n\n" + TURNS[-1][1].strip()])[0]
    # Only the last answer carries the (empty) think block, trained with it; earlier answers render plain, trimmed.
    runs = h.trained_runs(sample["input_ids"], sample["labels"])
    assert runs == [a + [end] for a in history] + [think + last + [end]]


def test_qwen3_5_keeps_the_last_reasoning_trimmed_and_drops_older_ones(qwen_processor, tmp_path, h, chat_images):
    turns = [
        (TURNS[0][0], " <think>\nlooking at it\n</think>\n\nA square."),
        (TURNS[1][0], "Hmm.<think>compare</think>The second."),
        (TURNS[2][0], "<think>\n  done, with spaces \n\n</think>\n\n No. "),
    ]
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5"})
    sample = _compare(h, qwen_processor, cfg, chat_images, turns=turns)
    last = h.trained_runs(sample["input_ids"], sample["labels"])[-1]
    assert qwen_processor.decode(last).endswith("<think>\ndone, with spaces\n</think>\n\n No.<|im_end|>")


def test_enable_thinking_false_drops_the_reasoning_and_leaves_the_empty_block_untrained(
    qwen_processor, tmp_path, h, chat_images
):
    """The tokens are the official template's for the answers without reasoning; the empty block is prompt."""
    reasoned = [*TURNS[:-1], (TURNS[-1][0], "<think>\nweighing it\n</think>\n\n" + TURNS[-1][1])]
    cfg = h.data_config(
        qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_5", "enable_thinking": False}
    )
    sample = _compare(h, qwen_processor, cfg, chat_images)
    dropped = SampleEncoder(cfg, qwen_processor).encode_row(h.chat_row(SYSTEM, reasoned, chat_images))
    assert dropped["input_ids"] == sample["input_ids"]
    end, think_end = qwen_processor.token_id("<|im_end|>"), qwen_processor.token_id("</think>")
    runs = h.trained_runs(dropped["input_ids"], dropped["labels"])
    assert runs[:-1] == [a + [end] for a in qwen_processor.encode_texts([a.strip() for _, a in TURNS[:-1]])]
    assert think_end not in runs[-1] and runs[-1][-1] == end
    assert qwen_processor.decode(runs[-1][:-1]).strip() == TURNS[-1][1].strip()
