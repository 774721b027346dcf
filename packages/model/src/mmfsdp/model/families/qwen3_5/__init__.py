"""The `qwen3_5` model family: its entry (`model`) and state-dict adapter (`adapter`); its test batches are
`qwen3_vl`'s (`mmfsdp.model.families.qwen3_vl.testing`)."""
