"""The `qwen3_vl_moe` model family: its entry (`model`, built on `qwen3_vl`'s) and state-dict adapter (`adapter`); its test helpers are `qwen3_vl`'s."""
