"""Write the tiny default run's model directory: `uv run python examples/tiny/make_assets.py`.

The directory holds a word-level tokenizer with Mistral's control tokens, the
Pixtral image-processor and processor configs, and a Mistral3 `config.json`
(no weights: the run uses `model.random_init: true`). The files are committed;
this script documents how they were made and regenerates them.
"""

import shutil
import sys
from pathlib import Path

from mmfsdp.data.families.mistral.synthetic import write_tiny_processor
from mmfsdp.model import get_model_entry

IMAGE_SIZE, PATCH_SIZE, MERGE = 64, 8, 2

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "assets"
    if out.exists():
        shutil.rmtree(out)
    ids = write_tiny_processor(out, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, spatial_merge_size=MERGE)
    config = get_model_entry("mistral3").testkit.tiny_config(
        vocab_size=ids["vocab_size"],
        image_token_index=ids["image_token_index"],
        text_config=dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
        ),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                           patch_size=PATCH_SIZE, image_size=IMAGE_SIZE),
        spatial_merge_size=MERGE,
    )
    config.save_pretrained(out)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
