"""Write Qwen3-Omni-30B-A3B-Instruct's `config.json` from its published dimensions (no download, no weights).

Used by the MindSpeed-MM recipe's memory-plan test. The field names are transformers 5's `Qwen3OmniMoeConfig`
(`thinker_config` with its `text_config`, `vision_config`, `audio_config`); the values are the published ones (the
checkpoint's config.json as transformers 5.7 loads it). Thinker text: Qwen3 MoE, 2048 hidden, 48 layers, 32 query
heads / 4 KV heads of 128, 128 experts of FFN 768 in every layer (top-8, renormalised), vocabulary 152064, untied
`lm_head`, rope theta 1e6 with interleaved M-RoPE sections 24/20/20. Vision: Qwen3-VL's tower (27 blocks of 1152,
DeepStack after 8, 16, 24) into 2048. Audio: 32 layers of 1280 (20 heads, FFN 5120), 128 mel bins, three stride-2
convolutions of 480 channels, `n_window` 50, into 2048. The talker and code2wav keep transformers' defaults: the
family does not build them (their tensors pass through exports untouched).
"""

import json
from pathlib import Path

from qwen3vl_30b_config import QWEN3_VL_30B_A3B_INSTRUCT

QWEN3_OMNI_30B_A3B_THINKER = {
    "model_type": "qwen3_omni_moe_thinker",
    "audio_token_id": 151675,
    "audio_start_token_id": 151669,
    "audio_end_token_id": 151670,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "position_id_per_seconds": 13,
    "seconds_per_chunk": 2,
    "user_token_id": 872,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_omni_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 768,
        "max_position_embeddings": 65536,
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
            "rope_type": "default", "rope_theta": 1000000, "mrope_section": [24, 20, 20], "interleaved": True,
            "mrope_interleaved": True,
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 152064,
    },
    # Qwen3-VL-30B-A3B's vision tower (`tests/qwen3vl_30b_config.py`), under Omni's model type
    "vision_config": {
        **QWEN3_VL_30B_A3B_INSTRUCT["vision_config"], "model_type": "qwen3_omni_moe_vision_encoder",
        "apply_vit_abs_pos_embed": True, "image_size": 768, "tokens_per_second": 2,
    },
    "audio_config": {
        "model_type": "qwen3_omni_moe_audio_encoder",
        "activation_function": "gelu",
        "conv_chunksize": 500,
        "d_model": 1280,
        "downsample_hidden_size": 480,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "encoder_layers": 32,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "num_mel_bins": 128,
        "output_dim": 2048,
        "scale_embedding": False,
    },
}
QWEN3_OMNI_30B_A3B_INSTRUCT = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "model_type": "qwen3_omni_moe",
    "enable_audio_output": True,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "tts_pad_token_id": 151671,
    "dtype": "bfloat16",
    "thinker_config": QWEN3_OMNI_30B_A3B_THINKER,
}


def write_qwen3omni_30b_config(model_dir: str | Path) -> Path:
    """Write `model_dir/config.json` (creating the directory) and return the directory."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_OMNI_30B_A3B_INSTRUCT, indent=2) + "\n")
    return model_dir
