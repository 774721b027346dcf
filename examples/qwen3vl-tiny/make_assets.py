"""Write the tiny Qwen3-VL run's model directory: `uv run python examples/qwen3vl-tiny/make_assets.py`.

The directory holds what a Qwen3-VL Instruct checkpoint holds, minus the weights
(the run uses `model.random_init: true`):

- `tokenizer.json`: a byte-level BPE with Qwen2's pre-tokenizer regex, NFC
  normaliser and byte-level decoder, trained on the few sentences of the
  coloured-shapes data and the chat roles, followed by Qwen3-VL's added tokens
  in Qwen's order (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, …, `<think>`,
  `</think>`), as the real vocabulary ends with them;
- `tokenizer_config.json`: EOS `<|im_end|>`, pad `<|endoftext|>`, no BOS, and the
  official Qwen3-VL Instruct chat template
  (`packages/data/tests/data/qwen3_vl_instruct_chat_template.jinja`);
- `preprocessor_config.json`: the `Qwen2VLImageProcessor` (16-px patches, merge 2,
  temporal patch 2, Qwen3-VL's 0.5 mean / std);
- `config.json`: a Qwen3-VL of ~1M parameters from `Qwen3VLTestKit.tiny_config`,
  its vocabulary and image / video / vision-start / vision-end ids those of the tokenizer.

The files are committed; this script documents how they were made and regenerates
them byte for byte (the BPE trainer is deterministic on a fixed corpus).
"""

import json
import shutil
import sys
from pathlib import Path

from mmfsdp.data.synthetic import COLOURS, PROMPT, SHAPES, VARLEN_QUESTIONS
from mmfsdp.model import get_model_entry

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = ROOT / "packages" / "data" / "tests" / "data" / "qwen3_vl_instruct_chat_template.jinja"
PATCH_SIZE, MERGE, TEMPORAL_PATCH = 16, 2, 2
BPE_VOCAB_SIZE = 512
"""Byte alphabet (256) + merges; the corpus runs out of pairs before this."""

QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split (the `Split` of its `tokenizer.json`)."""
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
"""Qwen3-VL's added tokens in id order, with the `special` flag of its `tokenizer.json`."""
UNSTRIPPED = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def corpus() -> list[str]:
    """The text the tiny BPE is trained on: every prompt and answer of the shapes data, and the chat roles."""
    answers = [f"a {colour} {shape}" for colour in COLOURS for shape in SHAPES]
    questions = [PROMPT.replace("<image>", ""), *VARLEN_QUESTIONS]
    roles = ["system\nYou are a helpful assistant.", "user\n", "assistant\n"]
    return [*roles, *questions, *answers, " ".join(answers)]


def write_tokenizer(out: Path) -> dict[str, int]:
    """`tokenizer.json` and `tokenizer_config.json`; returns the vocabulary size and the vision token ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(vocab_size=BPE_VOCAB_SIZE, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in QWEN_ADDED_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t, _ in QWEN_ADDED_TOKENS}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "special": special, **UNSTRIPPED}
            for t, special in QWEN_ADDED_TOKENS
        },
        "additional_special_tokens": [
            t for t, special in QWEN_ADDED_TOKENS if special and t not in ("<|endoftext|>", "<|im_end|>")
        ],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE.read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def write_image_processor(out: Path) -> None:
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "size": {"shortest_edge": (PATCH_SIZE * MERGE) ** 2, "longest_edge": 256 * 256},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "resample": 3,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model_config(out: Path, ids: dict[str, int]) -> None:
    config = get_model_entry("qwen3_vl").testkit.tiny_config(
        vocab_size=ids["vocab_size"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        text_config=dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
            rope_parameters={
                "rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 4, 4], "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
            patch_size=PATCH_SIZE, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
        ),
    )
    config.save_pretrained(out)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "assets"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ids = write_tokenizer(out)
    write_image_processor(out)
    write_model_config(out, ids)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
