"""LLaVA's state-dict adapter: the files on the Hub and what `save_pretrained` writes (transformers' `llava`
conversion mapping) use the original layout; `state_dict()` the new one. Names already new pass through.

| file (original)               | `state_dict()` (new)              |
| ----------------------------- | --------------------------------- |
| `language_model.model.*`      | `model.language_model.*`          |
| `language_model.lm_head.*`    | `lm_head.*`                       |
| `vision_tower.*`              | `model.vision_tower.*`            |
| `multi_modal_projector.*`     | `model.multi_modal_projector.*`   |
"""

from mmfsdp.ckpt.adapters import RenameAdapter

__all__ = ["LlavaAdapter"]


class LlavaAdapter(RenameAdapter):
    model_id = "llava"
    hf_model_types = ("llava",)
    architectures = ("LlavaForConditionalGeneration",)
    renames = (
        ("language_model.lm_head.", "lm_head."),
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
