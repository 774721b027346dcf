"""Qwen3.5 data (dense and MoE): the `qwen3_5` template. Images and videos go through Qwen3-VL's `qwen3_vl` plugin
and collator (Qwen3.5 checkpoints ship Qwen3-VL's processor: the same placeholders, patches and M-RoPE inputs)."""

from mmfsdp.data.families.qwen3_5 import template

__all__ = ["template"]
