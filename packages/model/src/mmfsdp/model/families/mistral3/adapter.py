"""Mistral3's state-dict adapter: HF safetensors file names <-> `state_dict()` names.

Declared under model id `mistral3` in the `mmfsdp.state_dict_adapters` entry-point group of this package, so
`mmfsdp.ckpt` (`mm-convert`, `load_hf_weights`) finds it by `--model_id` or by `config.json`'s `model_type`.
It is a pure rename, so `key_mapping()` is also the table for transformers' `from_pretrained(key_mapping=...)`.

The files on the Hub (e.g. Magistral-Small-2509), and what `save_pretrained` writes (its
`save_original_format=True` default; transformers' `llava` conversion mapping), use the original layout;
`state_dict()` uses the new one. Names that are already new pass through, so files in either naming load;
export writes the original naming.

| file (original)               | `state_dict()` (new)              |
| ----------------------------- | --------------------------------- |
| `language_model.model.*`      | `model.language_model.*`          |
| `language_model.lm_head.*`    | `lm_head.*`                       |
| `vision_tower.*`              | `model.vision_tower.*`            |
| `multi_modal_projector.*`     | `model.multi_modal_projector.*`   |
"""

from __future__ import annotations

from mmfsdp.ckpt.adapters import RenameAdapter

__all__ = ["Mistral3Adapter"]


class Mistral3Adapter(RenameAdapter):
    model_id = "mistral3"
    hf_model_types = ("mistral3",)
    architectures = ("Mistral3ForConditionalGeneration",)
    renames = (
        ("language_model.lm_head.", "lm_head."),
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
