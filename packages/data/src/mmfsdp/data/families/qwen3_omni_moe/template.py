"""The `qwen3_omni` and `qwen3_omni_nothink` chat templates (LLaMA-Factory's names, which MindSpeed-MM configs use).

Qwen3-Omni's ChatML is Qwen3-VL's: the same turns, think block and `enable_thinking` switch as `qwen3_vl` (Thinking)
and `qwen3_vl_nothink` (Instruct), so these templates are those with Qwen3-Omni's plugin as the default. An audio
clip is, where its `<audio>` placeholder is, `<|audio_start|>`, `<|audio_pad|>` × its tokens, `<|audio_end|>`: what
`Qwen3OmniMoeProcessor` makes of the chat template's `<|audio_start|><|audio_pad|><|audio_end|>` (the plugin's
`audio_tokens`).
"""

from __future__ import annotations

from mmfsdp.data.families.qwen3_vl.template import Qwen3VLNoThinkTemplate, Qwen3VLTemplate
from mmfsdp.data.templates import register_template

__all__ = ["Qwen3OmniNoThinkTemplate", "Qwen3OmniTemplate"]


@register_template
class Qwen3OmniNoThinkTemplate(Qwen3VLNoThinkTemplate):
    """Qwen3-Omni ChatML without a think block (Instruct checkpoints)."""

    name = "qwen3_omni_nothink"
    default_plugin = "qwen3_omni"


@register_template
class Qwen3OmniTemplate(Qwen3VLTemplate):
    """Qwen3-Omni ChatML whose last answer opens with its think block (Thinking checkpoints)."""

    name = "qwen3_omni"
    default_plugin = "qwen3_omni"
