"""LoRA presets resolve per family as they did when `mmfsdp.model.lora` held one table for all families.

Since issue 44 each family declares its presets (`ModelEntry.lora_presets`); what a config writes must mean what it
meant before. `TABLE_BEFORE` is that table, frozen here: for every registered family (the test-only LLaVA one
included) and each of its names, `preset:<name>` gives the modules its names gave written out, or is refused
(`ConfigError`) where they matched nothing; and a family declares no preset the table did not have.
"""

import pytest
import torch

import families.llava  # noqa: F401  (registers the test-only family)
from mmfsdp.config import ConfigError
from mmfsdp.model import get_model_entry, registered_model_ids, resolve_lora_targets

TABLE_BEFORE = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gated_deltanet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "vision_attention": ("model.visual.blocks.{*}.attn.qkv", "model.visual.blocks.{*}.attn.proj"),
}
"""`mmfsdp.model.lora.LORA_PRESETS` before issue 44."""
FAMILIES_BEFORE = {"mistral3", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "llava"}
"""The families of that time (and the test-only LLaVA family): their presets must be the table's."""


def _written_out(model, names, entry):
    """The modules `names` written out give, or None where one of them matches nothing (a `ConfigError`)."""
    try:
        return resolve_lora_targets(model, list(names), entry)
    except ConfigError:
        return None


@pytest.mark.parametrize("model_id", registered_model_ids())
def test_lora_presets_resolve_as_the_shared_table_did(model_id):
    entry = get_model_entry(model_id)
    with torch.device("meta"):
        model = entry.model_class._from_config(entry.testkit.tiny_config())
    if model_id not in FAMILIES_BEFORE:  # a family added since declares its own presets: each must resolve
        for preset in entry.lora_presets:
            assert resolve_lora_targets(model, [f"preset:{preset}"], entry), (model_id, preset)
        return
    assert set(entry.lora_presets) <= set(TABLE_BEFORE), entry.lora_presets
    for preset, names in TABLE_BEFORE.items():
        before = _written_out(model, names, entry)
        if before is None:
            with pytest.raises(ConfigError, match=r"^training\.lora\.target_modules\[0\]"):
                resolve_lora_targets(model, [f"preset:{preset}"], entry)
        else:
            assert entry.lora_presets[preset] == names
            assert resolve_lora_targets(model, [f"preset:{preset}"], entry) == before, (model_id, preset)
