"""State-dict adapters of the model families: HF safetensors file names <-> the model's `state_dict()` names.

Each family's adapter is declared as an entry point of group
`mmfsdp.state_dict_adapters` in this package's pyproject.toml, named by model
id, so `mmfsdp.ckpt` (`mm-convert`, `load_hf_weights`) finds it by `--model_id`
or by `config.json`'s `model_type` without knowing any family. Both families
here are pure renames, so `key_mapping()` is also the table for transformers'
`from_pretrained(key_mapping=...)`.

`mistral3` (`Mistral3ForConditionalGeneration`, e.g. Magistral-Small-2509):
the files on the Hub, and what `save_pretrained` writes (its
`save_original_format=True` default; transformers' `llava` conversion
mapping), use the original layout; `state_dict()` uses the new one. Names
that are already new pass through, so files in either naming load; export
writes the original naming.

| file (original)               | `state_dict()` (new)              |
| ----------------------------- | --------------------------------- |
| `language_model.model.*`      | `model.language_model.*`          |
| `language_model.lm_head.*`    | `lm_head.*`                       |
| `vision_tower.*`              | `model.vision_tower.*`            |
| `multi_modal_projector.*`     | `model.multi_modal_projector.*`   |

`qwen3_vl` (`Qwen3VLForConditionalGeneration`, e.g. Qwen3-VL-8B-Instruct):
the files already use the `state_dict()` names (`model.language_model.*`,
`model.visual.*`, `lm_head.*`; transformers 5 has no conversion mapping for
it), so the adapter renames nothing.
"""

from __future__ import annotations

from mmfsdp.ckpt.adapters import RenameAdapter

__all__ = ["Mistral3Adapter", "Qwen3VLAdapter"]


class Mistral3Adapter(RenameAdapter):
    model_id = "mistral3"
    hf_model_types = ("mistral3",)
    renames = (
        ("language_model.lm_head.", "lm_head."),
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )


class Qwen3VLAdapter(RenameAdapter):
    model_id = "qwen3_vl"
    hf_model_types = ("qwen3_vl",)
