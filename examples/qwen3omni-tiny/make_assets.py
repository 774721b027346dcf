"""Write the tiny Qwen3-Omni run's model directory: `uv run python examples/qwen3omni-tiny/make_assets.py`.

The directory holds what a Qwen3-Omni Instruct checkpoint holds, minus the weights (the run uses
`model.random_init: true`):

- the tokenizer: the tiny Qwen3-VL's (`examples/qwen3vl-tiny/assets`: a byte-level BPE with Qwen's added tokens)
  plus Qwen3-Omni's audio tokens `<|audio_start|>`, `<|audio_end|>`, `<|audio_pad|>`, the named media tokens its
  processor reads (`extra_special_tokens`), and Qwen3-Omni's Instruct chat template
  (`packages/data/tests/data/qwen3_omni_instruct_chat_template.jinja`);
- `preprocessor_config.json`: Qwen3-Omni's published feature extractor (Whisper features: 128 mel bins, 16 kHz, hop
  160, window 400) and the tiny Qwen3-VL's image processor (16-px patches, merge 2, temporal patch 2);
- `config.json`: a full `Qwen3OmniMoeConfig` whose thinker is `Qwen3OmniMoeTestKit.tiny_config` at the sizes of the
  tiny Qwen3-VL (decoder 128 wide, 2 MoE layers of 8 experts, top-2; vision tower 64 wide) with a 2-layer audio
  encoder 64 wide, and the smallest talker and code2wav (`testing.tiny_full_config`: the family does not train them).

The files are committed; this script documents how they were made and regenerates them.
"""

import json
import shutil
import sys
from pathlib import Path

from transformers import AutoTokenizer

from mmfsdp.data.families.qwen3_omni_moe.plugin import MEDIA_TOKEN_NAMES
from mmfsdp.model import get_model_entry
from mmfsdp.model.families.qwen3_omni_moe.testing import tiny_full_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "qwen3vl-tiny" / "assets"
CHAT_TEMPLATE = ROOT / "packages" / "data" / "tests" / "data" / "qwen3_omni_instruct_chat_template.jinja"
AUDIO_TOKENS = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
FEATURE_EXTRACTOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "hop_length": 160, "n_fft": 400,
    "n_samples": 4800000, "nb_max_frames": 30000, "sampling_rate": 16000, "chunk_length": 300,
    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
}
"""The published Qwen3-Omni-30B-A3B feature extractor settings."""


def write_tokenizer(out: Path) -> dict[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    tokenizer.add_tokens(list(AUDIO_TOKENS), special_tokens=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(extra_special_tokens=MEDIA_TOKEN_NAMES, chat_template=CHAT_TEMPLATE.read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # the template lives in tokenizer_config.json
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", *AUDIO_TOKENS, "<|im_end|>",
             "<|endoftext|>"]
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(names)))
    return {
        "vocab_size": len(tokenizer), "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "audio_end_token_id": ids["<|audio_end|>"],
        "audio_token_id": ids["<|audio_pad|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }


def write_preprocessor(out: Path) -> None:
    image = json.loads((BASE / "preprocessor_config.json").read_text())
    config = {**image, **FEATURE_EXTRACTOR, "processor_class": "Qwen3OmniMoeProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_model_config(out: Path, ids: dict[str, int]) -> None:
    base = json.loads((BASE / "config.json").read_text())
    text, vision = base["text_config"], base["vision_config"]
    thinker = get_model_entry("qwen3_omni_moe").testkit.tiny_config(
        vocab_size=ids["vocab_size"],
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        audio_token_id=ids["audio_token_id"], audio_start_token_id=ids["audio_start_token_id"],
        audio_end_token_id=ids["audio_end_token_id"],
        text_config={key: text[key] for key in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rope_parameters")} | {"eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"],
                                             "moe_intermediate_size": 64},
        vision_config={key: vision[key] for key in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "num_position_embeddings",
            "deepstack_visual_indexes", "patch_size", "spatial_merge_size", "temporal_patch_size")},
        audio_config=dict(d_model=64, encoder_attention_heads=4, encoder_ffn_dim=128, output_dim=text["hidden_size"],
                          downsample_hidden_size=16),
    )
    tiny_full_config(thinker).save_pretrained(out)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "assets"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ids = write_tokenizer(out)
    write_preprocessor(out)
    write_model_config(out, ids)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
