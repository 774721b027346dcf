"""Mistral3's state-dict adapter: HF safetensors file names <-> `state_dict()` names.

Declared under model id `mistral3` in the `mmfsdp.state_dict_adapters` entry-point group of this package, so
`mmfsdp.ckpt` (`mm-convert`, `load_hf_weights`) finds it by `--model_id` or by `config.json`'s `model_type`.
It is a pure rename, so `key_mapping()` is also the table for transformers' `from_pretrained(key_mapping=...)`.

The files on the Hub (e.g. Magistral-Small-2509), and what `save_pretrained` writes (its
`save_original_format=True` default), use the original layout of a vision tower, projector and LM side by side;
`state_dict()` uses transformers 5's nested one: `mmfsdp.ckpt.adapters.ORIGINAL_VLM_RENAMES` (its table).
"""

from __future__ import annotations

from mmfsdp.ckpt.adapters import ORIGINAL_VLM_RENAMES, RenameAdapter

__all__ = ["Mistral3Adapter"]


class Mistral3Adapter(RenameAdapter):
    model_id = "mistral3"
    hf_model_types = ("mistral3",)
    architectures = ("Mistral3ForConditionalGeneration",)
    renames = ORIGINAL_VLM_RENAMES
