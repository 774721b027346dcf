"""Qwen3-VL's state-dict adapter (model id `qwen3_vl`, entry-point group `mmfsdp.state_dict_adapters`).

The files (e.g. Qwen3-VL-8B-Instruct) already use the `state_dict()` names (`model.language_model.*`,
`model.visual.*`, `lm_head.*`; transformers 5 has no conversion mapping for it), so the adapter renames nothing.
"""

from __future__ import annotations

from mmfsdp.ckpt.adapters import RenameAdapter

__all__ = ["Qwen3VLAdapter"]


class Qwen3VLAdapter(RenameAdapter):
    model_id = "qwen3_vl"
    hf_model_types = ("qwen3_vl",)
    architectures = ("Qwen3VLForConditionalGeneration",)
