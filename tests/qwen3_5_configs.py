"""Write Qwen3.5-27B's and Qwen3.5-35B-A3B's `config.json` from their published dimensions (no download, no
weights), for the memory-plan test (`tests/test_e2e_qwen3_5_memory_plan.py`).

Field names are transformers' `Qwen3_5Config` / `Qwen3_5MoeConfig` (transformers 5 spelling: `rope_parameters`).

- Qwen3.5-27B (`Qwen/Qwen3.5-27B`, dense): 64 layers of hidden 5120, MLP 17408, `full_attention_interval` 4 (48
  Gated DeltaNet layers, 16 gated full-attention layers: 24 query heads / 4 KV heads of 256, partial rotary 0.25),
  Gated DeltaNet with 16 key heads and 48 value heads of 128 and a 4-tap convolution, vocabulary 248320, untied
  `lm_head`; vision: 27 blocks of 1152 (16 heads, MLP 4304), 16-px patches, 2 frames per temporal patch, 2x2
  merge into 5120, no DeepStack. Transformers' `Qwen3_5Config` defaults describe another size (32 layers of 4096,
  32 linear value heads), so every field is written. Source: the published `config.json`'s values as reproduced
  in public code (the `search` tool's code corpus: several repositories agree field by field, e.g.
  `linear_num_value_heads` 48, `linear_num_key_heads` 16, `head_dim` 256; THUDM/slime's
  `scripts/models/qwen3.5-27B.sh` gives the same 64 x 5120, 17408, 24 / 4 heads of 256 and vocabulary 248320).
- Qwen3.5-35B-A3B (`Qwen/Qwen3.5-35B-A3B`): transformers' `Qwen3_5MoeConfig` defaults (its docstring names the
  checkpoint): 40 layers of hidden 2048 (30 Gated DeltaNet with 16 key / 32 value heads of 128, 10 gated attention
  with 16 query / 2 KV heads of 256), 256 experts of 512, top 8, a gated shared expert of 512, vocabulary 248320,
  untied `lm_head`. One default does not fit the checkpoint: the vision merger's `out_hidden_size` (3584, another
  model's hidden size) must be the decoder's 2048, which is what the published file has; it is written here.
"""

import json
from pathlib import Path

from qwen3vl_30b_config import QWEN3_VL_30B_A3B_INSTRUCT

_VISION = {
    key: value
    for key, value in QWEN3_VL_30B_A3B_INSTRUCT["vision_config"].items()
    if key not in ("model_type", "deepstack_visual_indexes", "out_hidden_size")
}
"""Qwen3-VL's vision tower (27 blocks of 1152, 16 heads, MLP 4304, 16-px patches, 2x2 merge) without DeepStack."""
_TOKENS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    **_TOKENS,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "layer_types": _layer_types(64),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _ROPE,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
    "vision_config": {"model_type": "qwen3_5", **_VISION, "out_hidden_size": 5120},
}


def qwen3_5_35b_a3b() -> dict:
    """`Qwen3_5MoeConfig()`'s fields with the vision merger into the decoder's width (module docstring)."""
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig().to_dict()
    config.pop("transformers_version", None)
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    config["vision_config"]["out_hidden_size"] = config["text_config"]["hidden_size"]
    return config


def write_config(config: dict, model_dir: str | Path) -> Path:
    """Write `model_dir/config.json` (creating the directory) and return the directory."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir
