"""Write Qwen3-VL-30B-A3B-Instruct's `config.json` from its published dimensions (no download, no weights).

Used by the recipe's memory-plan test. The field names are those of transformers' `Qwen3VLMoeConfig` /
`Qwen3VLMoeTextConfig` / `Qwen3VLMoeVisionConfig` (transformers 5 spelling: `rope_parameters`); the values are
the published ones. Text: Qwen3 MoE, 2048 hidden, 48 layers, 32 query heads / 4 KV heads of 128, 128 experts
of FFN 768 in every layer (top-8, renormalised), vocabulary 151936, untied `lm_head`, rope theta 5e6 with
interleaved M-RoPE sections 24/20/20, 256k positions. Vision: 27 blocks of 1152 hidden, 16 heads, MLP 4304,
16-px patches, 2 frames per temporal patch, 2x2 merge into 2048, DeepStack mergers after blocks 8, 16 and 24.
Where the published file and transformers' defaults differ (the defaults describe another model: 24 layers,
60 experts, out_hidden 3584), every such field is written here.
"""

import json
from pathlib import Path

QWEN3_VL_30B_A3B_INSTRUCT = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True,
        },
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "vision_config": {
        "model_type": "qwen3_vl_moe",
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def write_qwen3vl_30b_config(model_dir: str | Path) -> Path:
    """Write `model_dir/config.json` (creating the directory) and return the directory."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_VL_30B_A3B_INSTRUCT, indent=2) + "\n")
    return model_dir
