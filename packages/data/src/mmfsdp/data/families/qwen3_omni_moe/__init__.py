"""Qwen3-Omni data (the thinker of `qwen3_omni_moe`): the `qwen3_omni` and `qwen3_omni_nothink` templates, the
`qwen3_omni` plugin (audio clips; images as Qwen3-VL's) and the `qwen3_omni` collator (alias `qwen3omni`)."""

from mmfsdp.data.families.qwen3_omni_moe import collator, plugin, template

__all__ = ["collator", "plugin", "template"]
