"""Qwen3.5's state-dict adapter (model id `qwen3_5`, entry-point group `mmfsdp.state_dict_adapters`).

The files (e.g. Qwen3.5-9B) use the `state_dict()` names (`model.language_model.*`, `model.visual.*`, `lm_head.*`;
transformers 5 has no conversion mapping for `Qwen3_5ForConditionalGeneration`), so the adapter renames nothing.
The hub's checkpoints also hold the multi-token-prediction head (`mtp.*`), which the HF model class does not have:
those tensors are not read (`skipped_hf_prefixes`, one log line) and an exported directory does not hold them.
"""

from __future__ import annotations

from mmfsdp.ckpt.adapters import RenameAdapter

__all__ = ["Qwen3_5Adapter"]


class Qwen3_5Adapter(RenameAdapter):
    model_id = "qwen3_5"
    hf_model_types = ("qwen3_5",)
    architectures = ("Qwen3_5ForConditionalGeneration",)
    skipped_hf_prefixes = (("mtp.", "the multi-token-prediction head; HF's Qwen3.5 model class has no such module"),)
