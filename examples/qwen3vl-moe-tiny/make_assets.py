"""Write the tiny Qwen3-VL MoE run's model directory: `uv run python examples/qwen3vl-moe-tiny/make_assets.py`.

The tokenizer, its config and the image processor are the tiny Qwen3-VL run's
(`examples/qwen3vl-tiny/make_assets.py` writes them the same way, byte for byte);
`config.json` is a Qwen3-VL MoE from `Qwen3VLMoeTestKit.tiny_config`: the qwen3vl-tiny
dimensions with every decoder MLP a sparse block of 8 experts, top-2, expert size
128, `router_aux_loss_coef` 0.01. No weights: the run uses `model.random_init: true`.
The files are committed; this script documents how they were made and regenerates them.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from mmfsdp.model import get_model_entry

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("qwen3vl_tiny_assets", HERE.parent / "qwen3vl-tiny" / "make_assets.py")
dense = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dense)


def write_model_config(out: Path, ids: dict[str, int]) -> None:
    config = get_model_entry("qwen3_vl_moe").testkit.tiny_config(
        vocab_size=ids["vocab_size"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        text_config=dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
            moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
            rope_parameters={
                "rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 4, 4], "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
            patch_size=dense.PATCH_SIZE, spatial_merge_size=dense.MERGE, temporal_patch_size=dense.TEMPORAL_PATCH,
        ),
    )
    config.save_pretrained(out)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "assets"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ids = dense.write_tokenizer(out)
    dense.write_image_processor(out)
    write_model_config(out, ids)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
