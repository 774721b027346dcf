"""LLaVA's state-dict adapter: the files on the Hub and what `save_pretrained` writes use the original layout,
`state_dict()` transformers 5's nested one (`mmfsdp.ckpt.adapters.ORIGINAL_VLM_RENAMES`, its table)."""

from mmfsdp.ckpt.adapters import ORIGINAL_VLM_RENAMES, RenameAdapter

__all__ = ["LlavaAdapter"]


class LlavaAdapter(RenameAdapter):
    model_id, hf_model_types = "llava", ("llava",)
    architectures, renames = ("LlavaForConditionalGeneration",), ORIGINAL_VLM_RENAMES
