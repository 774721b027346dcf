"""The `qwen3_vl` model family: its entry (`model`), state-dict adapter (`adapter`) and test helpers (`testing`)."""
