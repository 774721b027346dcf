"""Mistral / Pixtral data: the `mistral` template, the `pixtral` image plugin and the `pixtral` collator, and the
files `synthetic` writes for an offline tiny processor."""

from mmfsdp.data.families.mistral import collator, plugin, template

__all__ = ["collator", "plugin", "template"]
