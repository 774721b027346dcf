"""Qwen3-Omni (the thinker of HF `Qwen3OmniMoeForConditionalGeneration`) as model id `qwen3_omni_moe` (docs/families.md)."""
