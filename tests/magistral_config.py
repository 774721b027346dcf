"""Write Magistral-Small-2509's `config.json` from its published dimensions (no download, no weights).

Used by the recipe `--check` tests and the memory-plan tests. The field names are those of
transformers' `Mistral3Config` / `MistralConfig` / `PixtralVisionConfig`; the values are the
published ones (text: Mistral, 5120 hidden, 40 layers, 32 heads / 8 KV heads of 128, MLP 32768,
vocabulary 131072, rope theta 1e9, 128k positions; vision: Pixtral, 1024 hidden, 24 layers,
16 heads, MLP 4096, patch 14, images up to 1540; projector: 2×2 patch merge, no bias).
"""

import json
from pathlib import Path

MAGISTRAL_SMALL_2509 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "image_token_index": 10,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": {
        "model_type": "mistral",
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000000.0},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 131072,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 11,
    },
    "vision_config": {
        "model_type": "pixtral",
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


TEXT_CONFIG = MAGISTRAL_SMALL_2509["text_config"]
VISION_CONFIG = MAGISTRAL_SMALL_2509["vision_config"]


def write_magistral_config(model_dir: str | Path) -> Path:
    """Write `model_dir/config.json` (creating the directory) and return the directory."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MAGISTRAL_SMALL_2509, indent=2) + "\n")
    return model_dir
