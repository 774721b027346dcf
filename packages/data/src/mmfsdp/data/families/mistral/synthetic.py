"""A tiny offline Mistral tokenizer + Pixtral processor for the synthetic data (the `pixtral` plugin's
`write_tiny_processor` hook): a word-level `tokenizer.json` with Mistral's control tokens and the words of the
synthetic data (`mmfsdp.data.synthetic.WORDS`), plus the Pixtral image-processor and processor configs, so
`AutoTokenizer` and `build_processor` load it offline and the `mistral` template + `pixtral` plugin work on it.
It is written into a temporary sibling directory and renamed into place, so several ranks may call it at once.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmfsdp.data.synthetic import WORDS, _publish

__all__ = ["SPECIAL_TOKENS", "tiny_processor_ids", "write_tiny_processor"]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>")
"""Control tokens of the tiny tokenizer, with ids 0, 1, ... in this order."""


def tiny_processor_ids() -> dict[str, int]:
    """Token ids of the tiny tokenizer (the tiny model config needs `image_token_index` and `vocab_size`)."""
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "vocab_size": len(SPECIAL_TOKENS) + len(WORDS),
        "unk_token_id": ids["<unk>"],
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "image_token_index": ids["[IMG]"],
        "image_break_token_id": ids["[IMG_BREAK]"],
        "image_end_token_id": ids["[IMG_END]"],
    }


def write_tiny_processor(out_dir: str | Path, *, image_size: int, patch_size: int, spatial_merge_size: int) -> dict[str, int]:
    """Write a tiny offline tokenizer + Pixtral processor into `out_dir` (unless it exists); returns `tiny_processor_ids()`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    out_dir = Path(out_dir)
    if out_dir.is_dir() and (out_dir / "tokenizer.json").is_file():
        vocab = json.loads((out_dir / "tokenizer.json").read_text()).get("model", {}).get("vocab", {})
        if missing := [w for w in WORDS if w not in vocab]:
            from mmfsdp.data.errors import DataError

            raise DataError(
                f"{out_dir}/tokenizer.json lacks the words {missing} of the synthetic data (written by an older "
                "version); delete the directory to regenerate it"
            )
        return tiny_processor_ids()

    def write(tmp: Path) -> None:
        vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *WORDS))}
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        tokenizer.save(str(tmp / "tokenizer.json"))
        special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
        files = {
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False, **special},
            "special_tokens_map.json": special,
            "preprocessor_config.json": {
                "image_processor_type": "PixtralImageProcessor",
                "processor_class": "PixtralProcessor",
                "patch_size": {"height": patch_size, "width": patch_size},
                "size": {"longest_edge": image_size},
                "do_resize": True,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_convert_rgb": True,
                "resample": 3,
            },
            "processor_config.json": {
                "processor_class": "PixtralProcessor",
                "patch_size": patch_size,
                "spatial_merge_size": spatial_merge_size,
                "image_token": "[IMG]",
                "image_break_token": "[IMG_BREAK]",
                "image_end_token": "[IMG_END]",
            },
        }
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2))

    _publish(out_dir, write)
    return tiny_processor_ids()
