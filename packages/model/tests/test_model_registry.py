"""Config sections, the registry, the spec a family fills, the mistral3 entry: build paths, plans, meta init,
freezing, key map."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from mmfsdp.config import ConfigError, build
from mmfsdp.model import (
    FamilyCosts, FamilyTestKit, FeaturesConfig, HFFamilyEntry, ModelConfig, ModelEntry, freeze_modules,
    get_model_entry, register_model, registered_model_ids,
)
from mmfsdp.model.families.mistral3.model import Mistral3ForConditionalGenerationFSDP
from mmfsdp.model.chunk_loss import ChunkLossLinear
from mmfsdp.model.testing import assert_close, model_inputs
from mmfsdp.model.families.mistral3.testing import tiny_batch
from mmfsdp.model.spec import REQUIRED_MEMBERS, missing_members
from mmfsdp.parallel.patterns import match_module_names

ENTRY = get_model_entry("mistral3")


# -- config -----------------------------------------------------------------------------------


def test_model_id_defaults_to_the_family_of_config_json(tmp_path):
    ENTRY.testkit.tiny_config().save_pretrained(tmp_path)
    assert build(ModelConfig, {"model_name_or_path": str(tmp_path)}, "model").model_id == "mistral3"


def test_defaults_build():
    model = build(ModelConfig, {}, "model")
    # no model_id and no config.json to take it from: none (the trainer's checks ask for it by key)
    assert (model.model_id, model.attn_implementation, model.dtype, model.freeze) == (None, "sdpa", "fp32", [])
    features = build(FeaturesConfig, {}, "features")
    assert not features.enable_chunk_loss
    assert features.chunkloss_plan.chunk_size == 1024 and features.loss_cfg.loss_type == "default"


@pytest.mark.parametrize(
    "section, data, key, hint",
    [
        (ModelConfig, {"model_id": "mistral33"}, "model.model_id", "did you mean 'mistral3'"),
        (ModelConfig, {"attn_implementation": "spda"}, "model.attn_implementation", "did you mean 'sdpa'"),
        (ModelConfig, {"dtype": "bf32"}, "model.dtype", "is not one of"),
        (FeaturesConfig, {"chunkloss_plan": {"chunk_size": 0}}, "features.chunkloss_plan.chunk_size", "positive"),
        (FeaturesConfig, {"loss_cfg": {"loss_type": "per_samples"}}, "features.loss_cfg.loss_type", "did you mean 'per_sample'"),
    ],
)
def test_config_mistakes_name_their_key(section, data, key, hint):
    with pytest.raises(ConfigError, match=re.escape(hint)) as err:
        build(section, data, section is ModelConfig and "model" or "features")
    assert err.value.key == key


def test_unknown_model_id_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'mistral3'"):
        get_model_entry("mistral")


# -- the spec a family fills (docs/families.md) -------------------------------------------------


def test_docs_state_the_count_of_required_members():
    text = (Path(__file__).resolve().parents[3] / "docs" / "families.md").read_text()
    assert len(REQUIRED_MEMBERS) == 7 and f"**{len(REQUIRED_MEMBERS)} required members**" in text
    assert all(f"`{name}`" in text for name in REQUIRED_MEMBERS)


def test_an_hf_spec_of_only_the_required_members_is_complete_and_gets_the_defaults():
    class Minimal(HFFamilyEntry):
        config_class = Mistral3Config
        model_class = Mistral3ForConditionalGenerationFSDP
        fsdp_modules = ("model.language_model.layers.{*}",)
        recompute_modules = ("model.language_model.layers.{*}",)

    assert missing_members(Minimal) == []
    assert missing_members(ModelEntry) == list(REQUIRED_MEMBERS[1:])
    spec = Minimal()
    assert type(spec.costs) is FamilyCosts and type(spec.testkit) is FamilyTestKit
    assert not spec.capabilities.context_parallel and spec.data.templates == () and spec.vision_modules == ()


def test_register_model_refuses_a_spec_without_a_required_member():
    class NoRecompute(HFFamilyEntry):
        config_class = Mistral3Config
        model_class = Mistral3ForConditionalGenerationFSDP
        fsdp_modules = ("model.language_model.layers.{*}",)

    with pytest.raises(TypeError, match=r"'no_recompute' \(.*NoRecompute\) does not set recompute_modules$"):
        register_model("no_recompute")(NoRecompute)
    assert "no_recompute" not in registered_model_ids()


def test_the_llava_spec_defines_the_required_members_and_beyond_them_only_declarations_facets_and_two_hooks():
    """The test-only family, written as a user writes one: its class body is the required members an HF family
    writes, what it declares (vision modules, capabilities, data, LoRA presets), its costs and test kit, and the two
    hooks a family outside an installed package with CLIP's buffers needs."""
    from families.llava import LlavaEntry

    written = {name for name in vars(LlavaEntry) if not name.startswith("__")}
    required = set(REQUIRED_MEMBERS) - {"model_id", "build", "init_non_persistent_buffers"}  # decorator; HFFamilyEntry
    assert required <= written
    declared = {"vision_modules", "capabilities", "data", "lora_presets", "costs", "testkit"}
    assert written - required <= declared | {"state_dict_adapter", "init_non_persistent_buffers"}


# -- the entry --------------------------------------------------------------------------------


def test_plans_name_real_modules(tiny_config):
    model = Mistral3ForConditionalGenerationFSDP(tiny_config)
    layers = tiny_config.text_config.num_hidden_layers + tiny_config.vision_config.num_hidden_layers
    assert len(match_module_names(model, list(ENTRY.fsdp_modules))) == layers + 3
    assert len(match_module_names(model, list(ENTRY.recompute_modules))) == layers
    assert match_module_names(model, list(ENTRY.vision_modules)) == list(ENTRY.vision_modules)
    assert isinstance(model.get_submodule(ENTRY.lm_head_name), ChunkLossLinear)


def test_tiny_config_is_tiny_and_overridable():
    config = ENTRY.testkit.tiny_config(vocab_size=300, image_token_index=7, text_config={"num_hidden_layers": 3})
    assert config.text_config.vocab_size == 300 and config.image_token_index == 7
    assert config.text_config.num_hidden_layers == 3 and config.vision_config.patch_size == 8
    assert sum(p.numel() for p in Mistral3ForConditionalGeneration(config).parameters()) < 5_000_000


def _apply_key_map(key: str) -> str:
    from mmfsdp.model.families.mistral3.adapter import Mistral3Adapter

    return Mistral3Adapter().model_key(key)


def test_adapter_renames_the_original_checkpoint_layout(tiny_config):
    keys = Mistral3ForConditionalGenerationFSDP(tiny_config).state_dict().keys()
    for key in keys:
        old = re.sub(r"^model\.language_model\.", "language_model.model.", key)
        old = re.sub(r"^lm_head\.", "language_model.lm_head.", old)
        old = re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", old)
        assert _apply_key_map(old) == key
        assert _apply_key_map(key) == key


@pytest.fixture
def saved(tmp_path, tiny_config):
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(tiny_config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


def test_build_loads_safetensors_weights(saved):
    path, reference = saved
    model_cfg = build(ModelConfig, {"model_name_or_path": str(path)}, "model")
    features = build(FeaturesConfig, {"enable_chunk_loss": True, "chunkloss_plan": {"chunk_size": 8}}, "features")
    model = ENTRY.build(model_cfg, features)
    assert isinstance(model, Mistral3ForConditionalGenerationFSDP) and model.chunk_loss_size == 8
    assert model.config._attn_implementation == "mmfsdp_sdpa"
    ref_state = reference.state_dict()
    assert all(torch.equal(value, ref_state[key]) for key, value in model.state_dict().items())


def test_build_refuses_a_checkpoint_with_missing_weights(saved):
    path, _ = saved
    (weights_file,) = path.glob("*.safetensors")
    tensors = load_file(weights_file)
    dropped = next(key for key in tensors if "layers.1" in key)
    del tensors[dropped]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model keys not in the files"):
        ENTRY.build(build(ModelConfig, {"model_name_or_path": str(path)}, "model"))


def test_build_with_random_init_and_dtype(saved):
    path, reference = saved
    model_cfg = build(ModelConfig, {"model_name_or_path": str(path), "random_init": True, "dtype": "bf16"}, "model")
    model = ENTRY.build(model_cfg)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not torch.equal(model.lm_head.weight.float(), reference.lm_head.weight.bfloat16().float())
    assert model.chunk_loss_size is None


def test_meta_build_then_load_gives_the_hf_logits(saved):
    path, reference = saved
    model = ENTRY.build(build(ModelConfig, {"model_name_or_path": str(path)}, "model"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected
    ENTRY.init_non_persistent_buffers(model)
    batch = model_inputs(tiny_batch(reference.config, seq_len=24))
    with torch.no_grad():
        assert_close(model(**batch).logits, reference(**batch).logits, 1e-5, "logits after meta build and load")


def test_missing_model_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model_name_or_path") as err:
        ENTRY.build(build(ModelConfig, {}, "model"))
    assert err.value.key == "model.model_name_or_path"
    with pytest.raises(ConfigError, match="no config.json"):
        ENTRY.build(build(ModelConfig, {"model_name_or_path": str(tmp_path)}, "model"))


def test_model_directory_without_safetensors_is_one_line(saved):
    path, _ = saved
    (weights_file,) = path.glob("*.safetensors")
    weights_file.rename(path / "pytorch_model.bin")
    model_cfg = build(ModelConfig, {"model_name_or_path": str(path)}, "model")
    with pytest.raises(ConfigError) as err:
        ENTRY.build(model_cfg)
    text = str(err.value)
    assert err.value.key == "model.model_name_or_path" and "\n" not in text
    assert str(path) in text and "no safetensors" in text and ".bin" in text
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ConfigError, match="missing 1 of the 1 shards"):
        ENTRY.build(model_cfg)


def test_freeze_modules_by_pattern(tiny_config):
    model = Mistral3ForConditionalGenerationFSDP(tiny_config)
    names = freeze_modules(model, ["model.vision_tower", "model.language_model.layers.{0-0}"])
    assert names == ["model.vision_tower", "model.language_model.layers.0"]
    for name, param in model.named_parameters():
        frozen = name.startswith("model.vision_tower.") or name.startswith("model.language_model.layers.0.")
        assert param.requires_grad is not frozen, name
    with pytest.raises(ConfigError, match=re.escape("model.freeze[0]")):
        freeze_modules(model, ["model.vision_towr"])


def test_current_module_name_reads_another_layouts_names():
    from mmfsdp.model.spec import current_module_name

    legacy = (("visual", "model.visual"), ("audio_tower", "model.audio_tower"), ("model", "model.language_model"))
    cases = {
        "visual.blocks.{*}": "model.visual.blocks.{*}", "visual": "model.visual", "audio_tower": "model.audio_tower",
        "model.layers.{*}": "model.language_model.layers.{*}", "model.embed_tokens": "model.language_model.embed_tokens",
        "model": "model.language_model",
        # already the model's names, or names of neither layout: unchanged
        "model.visual.blocks.{*}": "model.visual.blocks.{*}", "model.language_model.layers.{*}": "model.language_model.layers.{*}",
        "model.audio_tower": "model.audio_tower", "lm_head": "lm_head", "visualizer": "visualizer", "q_proj": "q_proj",
        "preset:attention": "preset:attention",
    }
    assert {name: current_module_name(name, legacy) for name in cases} == cases
    assert current_module_name("visual.blocks", ()) == "visual.blocks"
