"""Qwen3-VL data (dense and MoE): the `qwen3_vl` and `qwen3_vl_nothink` templates, the `qwen3_vl` image and video
plugin (alias `qwen2_vl`) and the `qwen3_vl` collator (alias `qwen3vl`)."""

from mmfsdp.data.families.qwen3_vl import collator, plugin, template

__all__ = ["collator", "plugin", "template"]
