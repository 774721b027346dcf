"""The `qwen3_5_moe` model family: its entry (`model`, built on `qwen3_5`'s) and state-dict adapter (`adapter`)."""
