"""End to end with transformers: Mistral3 HF -> DCP -> HF, `from_pretrained` logits, and meta-device loading.

A tiny `Mistral3ForConditionalGeneration` (text + Pixtral vision tower, untied
lm_head like Magistral) is saved with `save_pretrained(max_shard_size=...)`, which
writes several shards in the original `language_model.model.*` naming.

Qwen3.5 rows (`QWEN3_5_CASES`): `qwen3_5` and `qwen3_5_moe` HF -> DCP -> HF is bitwise in fp32 and bf16, for the
MoE in both file layouts of the routed experts (`save_pretrained`'s per-expert one, the hub's, and the fused
`state_dict()` one), and the exported directory gives `from_pretrained` logits equal to the original's.

Exports any server loads (`hf_exports.EXAMPLE_CONFIGS`, one row per family): the export of a checkpoint saved as
the trainer saves it names the family's HF class in `config.json` `architectures` (assets without one), its
`generation_config.json` stops at the end token of the family's chat template, and transformers' `pipeline` loads
it through the Auto classes (no remote code) and generates from an image prompt and a text-only one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

import hf_exports
from mmfsdp.ckpt import SafetensorsDir, load_checkpoint, load_hf_weights
from mmfsdp.ckpt.cli import main as mm_convert

IMAGE_TOKEN = 5


def tiny_config() -> Mistral3Config:
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=1e6, sliding_window=None,
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                  image_size=32, patch_size=8, num_channels=3)
    return Mistral3Config(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN, spatial_merge_size=2,
                          multimodal_projector_bias=False, tie_word_embeddings=False)


def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    # 32x32 image, 8x8 patches, 2x2 merge: 4 image tokens
    ids = torch.tensor([[1, 17, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 23, 42, 7, 64, 3, 88]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(1, 3, 32, 32, generator=gen), "image_sizes": torch.tensor([[32, 32]])}


@torch.no_grad()
def logits_of(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(**inputs()).logits


def save_tiny(path: Path, dtype: torch.dtype) -> Mistral3ForConditionalGeneration:
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(tiny_config()).to(dtype)
    model.save_pretrained(path, max_shard_size="60KB")
    (path / "tokenizer.json").write_text('{"model": "tiny"}')
    (path / "chat_template.jinja").write_text("{{ messages }}")
    return model


def init_rotary_buffers(model: torch.nn.Module) -> None:
    """Recompute rotary `inv_freq` after `to_empty` with the HF module's own init (it is not in checkpoints)."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, name, buffer)


def read_files(directory: Path) -> dict[str, torch.Tensor]:
    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_dcp_hf_round_trip_and_from_pretrained_logits(tmp_path, dtype):
    original = tmp_path / "hf"
    save_tiny(original, dtype)
    shards = sorted(p.name for p in original.glob("*.safetensors"))
    assert len(shards) >= 3 and (original / "model.safetensors.index.json").is_file()
    assert any(key.startswith("language_model.model.") for key in SafetensorsDir(original).tensors)

    assert mm_convert(["GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(original), "--dcp_dir", str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert mm_convert(["GenericDCPConverter", "dcp_to_hf", "--load_dir", str(tmp_path / "dcp"), "--save_dir",
                       str(tmp_path / "out"), "--model_assets_dir", str(original), "--max_shard_size", "100KB"]) == 0

    before, after = read_files(original), read_files(tmp_path / "out")
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype == dtype and torch.equal(before[key], after[key]), key
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (original / name).read_bytes()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(before)

    reference = Mistral3ForConditionalGeneration.from_pretrained(original)
    exported = Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert exported.dtype == reference.dtype == dtype
    assert torch.equal(logits_of(exported), logits_of(reference))


def test_meta_device_model_loaded_from_hf_or_release_matches_from_pretrained(tmp_path):
    original = tmp_path / "hf"
    save_tiny(original, torch.float32)
    expected = logits_of(Mistral3ForConditionalGeneration.from_pretrained(original))

    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(tiny_config())
    model.to_empty(device="cpu")
    init_rotary_buffers(model)
    result = load_hf_weights(model, original)  # key map from config.json model_type: mistral3
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(logits_of(model), expected)

    assert mm_convert(["GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(original), "--dcp_dir", str(tmp_path / "dcp")]) == 0
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(tiny_config())
    model.to_empty(device="cpu")
    init_rotary_buffers(model)
    assert load_checkpoint(tmp_path / "dcp", model=model).iteration == "release"
    assert torch.equal(logits_of(model), expected)


QWEN3_5_CASES = [
    pytest.param("qwen3_5", False, torch.float32, id="qwen3_5"),
    pytest.param("qwen3_5", False, torch.bfloat16, id="qwen3_5-bf16"),
    pytest.param("qwen3_5_moe", False, torch.bfloat16, id="qwen3_5_moe-hub_per_expert-bf16"),
    pytest.param("qwen3_5_moe", True, torch.float32, id="qwen3_5_moe-fused"),
]
"""(model id, files in the `state_dict()` layout (fused routed experts) instead of `save_pretrained`'s (the hub's:
per-expert), dtype)."""


def save_state_dict_layout(model: torch.nn.Module, path: Path) -> None:
    """The model's `state_dict()` as it is (transformers 5's fused experts `[E, 2I, H]`, `[E, H, I]`), two shards."""
    from safetensors.torch import save_file

    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, shard in shards.items():
        save_file({key: state[key] for key in shard}, path / name, metadata={"format": "pt"})
    weight_map = {key: name for name, shard in shards.items() for key in shard}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("model_id, fused, dtype", QWEN3_5_CASES)
def test_qwen3_5_hf_dcp_hf_round_trip_is_bitwise(tmp_path, model_id, fused, dtype):
    """`mm-convert` HF -> DCP -> HF of a tiny Qwen3.5 (Gated DeltaNet, gated attention, vision tower; MoE with a
    shared expert) gives the files back bitwise, in the layout they came in, and the same logits."""
    from mmfsdp.model import get_model_entry
    from mmfsdp.model.testing import model_inputs

    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    hf_class = entry.model_class.__bases__[-1]
    torch.manual_seed(0)
    model = hf_class(config).to(dtype)
    original = tmp_path / "hf"
    model.save_pretrained(original, max_shard_size="200KB")
    if fused:
        for file in [*original.glob("*.safetensors"), original / "model.safetensors.index.json"]:
            file.unlink(missing_ok=True)
        save_state_dict_layout(model, original)
    files = read_files(original)
    assert len(list(original.glob("*.safetensors"))) > 1
    assert any(".linear_attn.in_proj_qkv." in key for key in files)
    if model_id == "qwen3_5_moe":
        assert any(".mlp.experts.gate_up_proj" in key for key in files) == fused
        assert any(".mlp.experts.0.gate_proj.weight" in key for key in files) != fused

    dcp = tmp_path / "dcp"
    assert mm_convert(["GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(original), "--dcp_dir", str(dcp)]) == 0
    assert mm_convert(["GenericDCPConverter", "dcp_to_hf", "--load_dir", str(dcp), "--save_dir",
                       str(tmp_path / "out"), "--model_assets_dir", str(original)]) == 0
    after = read_files(tmp_path / "out")
    assert files.keys() == after.keys()
    for key in files:
        assert files[key].dtype == after[key].dtype == dtype and torch.equal(files[key], after[key]), key

    batch = model_inputs(entry.testkit.test_batch(config, images=True, seed=1))
    batch = {key: value.to(dtype) if value.is_floating_point() else value for key, value in batch.items()}
    with torch.no_grad():
        reference = hf_class.from_pretrained(original).eval()(**batch).logits
        exported = hf_class.from_pretrained(tmp_path / "out").eval()(**batch).logits
    assert torch.equal(exported, reference)


STOP_TEXTS = {"mistral3": ["</s>"], "qwen3_vl": ["<|im_end|>"], "qwen3_vl_moe": ["<|im_end|>"],
              "qwen3_5": ["<|im_end|>"], "qwen3_5_moe": ["<|im_end|>"]}
"""The tokens that end an answer in each family's chat template, as text (docs/data.md's formats)."""


@pytest.mark.parametrize("model_id", sorted(hf_exports.EXAMPLE_CONFIGS))
def test_an_export_of_each_family_generates_with_transformers(tmp_path, model_id):
    import transformers
    from PIL import Image
    from transformers import GenerationConfig, pipeline

    from mmfsdp.model import get_model_entry

    export = hf_exports.export_example(hf_exports.EXAMPLE_CONFIGS[model_id], tmp_path)
    (architecture,) = json.loads((export.path / "config.json").read_text())["architectures"]
    assert issubclass(get_model_entry(model_id).model_class, getattr(transformers, architecture))
    assert GenerationConfig.from_pretrained(export.path).eos_token_id == export.stop_token_ids

    pipe = pipeline("image-text-to-text", model=str(export.path))  # AutoModelForImageTextToText, AutoProcessor
    assert type(pipe.model).__name__ == architecture
    assert pipe.processor.tokenizer.convert_ids_to_tokens(export.stop_token_ids) == STOP_TEXTS[model_id]
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    for inputs in (pipe.processor(text=[f"{pipe.processor.image_token}What shape is this?"], images=[image],
                                  return_tensors="pt"),
                   pipe.processor(text=["Count from one to ten:"], return_tensors="pt")):
        with torch.no_grad():
            generated = pipe.model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert generated.shape == (1, inputs["input_ids"].shape[1] + 3)
