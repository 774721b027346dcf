"""Write the tiny Qwen3.5 run's model directory: `uv run python examples/qwen3_5-tiny/make_assets.py`.

The directory holds what a Qwen3.5 checkpoint holds, minus the weights (the run uses `model.random_init: true`):

- `tokenizer.json`, `tokenizer_config.json`, `preprocessor_config.json`: those of the tiny Qwen3-VL run
  (`examples/qwen3vl-tiny/make_assets.py`: a byte-level BPE with Qwen's regex and added tokens, trained on the
  shapes data; Qwen3.5 checkpoints ship Qwen3-VL's processor), with the official Qwen3.5 chat template
  (`packages/data/tests/data/qwen3_5_chat_template.jinja`) in place of Qwen3-VL's;
- `config.json`: a Qwen3.5 of ~0.86M parameters from `Qwen3_5TestKit.tiny_config` (Gated DeltaNet, Gated DeltaNet,
  full attention), its vocabulary and image / video / vision-start / vision-end ids those of the tokenizer.

The files are committed; this script documents how they were made and regenerates them byte for byte.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

from mmfsdp.model import get_model_entry

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = ROOT / "packages" / "data" / "tests" / "data" / "qwen3_5_chat_template.jinja"


def qwen3vl_assets():
    """The tiny Qwen3-VL run's asset writer (`examples/qwen3vl-tiny/make_assets.py`), loaded by path."""
    spec = importlib.util.spec_from_file_location("qwen3vl_tiny_assets", ROOT / "examples/qwen3vl-tiny/make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_model_config(out: Path, ids: dict[str, int], assets, model_id: str = "qwen3_5", **text_extra) -> None:
    """`config.json` of a `model_id` family (`qwen3_5`, or `qwen3_5_moe` with `text_extra`'s MoE sizes) at the
    dimensions below."""
    config = get_model_entry(model_id).testkit.tiny_config(
        vocab_size=ids["vocab_size"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        text_config={
            "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"],
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            **text_extra,
        },
        vision_config={
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
            "num_position_embeddings": 64, "patch_size": assets.PATCH_SIZE, "spatial_merge_size": assets.MERGE,
            "temporal_patch_size": assets.TEMPORAL_PATCH,
        },
    )
    config.save_pretrained(out)


def write_tokenizer_and_processor(out: Path, assets) -> dict[str, int]:
    """The tokenizer (with the Qwen3.5 chat template) and the image processor; returns the tokenizer's ids."""
    ids = assets.write_tokenizer(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    assets.write_image_processor(out)
    return ids


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "assets"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    assets = qwen3vl_assets()
    ids = write_tokenizer_and_processor(out, assets)
    write_model_config(out, ids, assets)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
