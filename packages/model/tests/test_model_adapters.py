"""The families' state-dict adapters (`mmfsdp.model.families.<model_id>.adapter`), found by `mmfsdp.ckpt` through entry points.

mistral3: renames both ways, the same table as the adapter's `key_mapping()` for `from_pretrained`, `mm-convert` and
`load_hf_weights` on files in the original naming. qwen3_vl: a tiny `Qwen3VLForConditionalGeneration`
saved with `save_pretrained` in several shards goes HF -> DCP -> HF bit-exact through `mm-convert`
(model type detected from config.json, or `--model_id`), and `from_pretrained` of the export gives
the original's logits exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from mmfsdp.ckpt import (
    find_state_dict_adapter,
    get_state_dict_adapter,
    load_checkpoint,
    load_hf_weights,
)
from mmfsdp.ckpt.dcp_io import read_dcp_metadata
from mmfsdp.model.families.mistral3.adapter import Mistral3Adapter
from mmfsdp.model.families.qwen3_vl.adapter import Qwen3VLAdapter
from mmfsdp.model.testing import assert_bit_exact, mm_convert, read_safetensors

IMAGE_TOKEN, VISION_START, VISION_END = 250, 252, 253


def test_entry_points_register_both_families():
    assert isinstance(get_state_dict_adapter("mistral3"), Mistral3Adapter)
    assert isinstance(get_state_dict_adapter("qwen3_vl"), Qwen3VLAdapter)
    assert isinstance(find_state_dict_adapter({"model_type": "mistral3"}), Mistral3Adapter)
    assert isinstance(find_state_dict_adapter({"model_type": "qwen3_vl"}), Qwen3VLAdapter)


def test_mistral3_renames_are_inverse_and_the_model_entry_table():
    legacy = [
        "language_model.model.layers.0.self_attn.q_proj.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "vision_tower.transformer.layers.0.attention.k_proj.weight",
        "multi_modal_projector.linear_1.weight",
    ]
    new = [
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
        "model.vision_tower.transformer.layers.0.attention.k_proj.weight",
        "model.multi_modal_projector.linear_1.weight",
    ]
    adapter = Mistral3Adapter()
    assert [adapter.model_key(k) for k in legacy] == new
    assert [adapter.hf_key(k) for k in new] == legacy
    # names that are already new pass through, so either kind of file loads
    assert [adapter.model_key(k) for k in new] == new
    assert Qwen3VLAdapter().key_mapping() == {}


def test_mistral3_names_round_trip_through_state_dict_names(tmp_path):
    legacy = {
        "language_model.model.embed_tokens.weight": torch.randn(16, 8),
        "language_model.model.layers.0.mlp.weight": torch.randn(4, 8).to(torch.bfloat16),
        "language_model.lm_head.weight": torch.randn(16, 8),
        "vision_tower.patch_conv.weight": torch.randn(8, 3, 2, 2),
        "multi_modal_projector.linear_1.weight": torch.randn(8, 8),
    }
    config = {"model_type": "mistral3", "text_config": {"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1}}
    hf = tmp_path / "hf"
    hf.mkdir()
    names = list(legacy)
    weight_map = {}
    for index, part in enumerate((names[0::2], names[1::2])):
        filename = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: legacy[name] for name in part}, hf / filename)
        weight_map.update({name: filename for name in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / "config.json").write_text(json.dumps(config))

    assert mm_convert("hf_to_dcp", "--hf_dir", hf, "--dcp_dir", tmp_path / "dcp") == 0
    keys = sorted(read_dcp_metadata(tmp_path / "dcp" / "release").state_dict_metadata)
    assert keys == sorted(
        [
            "model.model.language_model.embed_tokens.weight",
            "model.model.language_model.layers.0.mlp.weight",
            "model.lm_head.weight",
            "model.model.vision_tower.patch_conv.weight",
            "model.model.multi_modal_projector.linear_1.weight",
        ]
    )
    assert (
        mm_convert("dcp_to_hf", "--load_dir", tmp_path / "dcp", "--save_dir", tmp_path / "out", "--model_assets_dir", hf)
        == 0
    )
    assert_bit_exact(read_safetensors(tmp_path / "out"), legacy)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 6)


@pytest.mark.parametrize("how", ["model_id", "config"])
def test_load_hf_weights_reads_original_mistral3_names(tmp_path, how):
    torch.manual_seed(0)
    tensors = {k: v.clone() for k, v in _Net().state_dict().items()}
    save_file({f"language_model.model.{k}": v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral3"}))
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.language_model = _Net()
    load_hf_weights(model, tmp_path, adapter="mistral3" if how == "model_id" else None)
    for key, value in tensors.items():
        assert torch.equal(model.model.language_model.state_dict()[key], value)


def tiny_qwen3_vl_config(tie_word_embeddings: bool) -> Qwen3VLConfig:
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[0, 1],
        num_position_embeddings=16,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=251,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tie_word_embeddings,
    )


def qwen3_vl_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    # one 64x64 image: 4x4 patches of 16, 2x2 merge -> 4 image tokens
    ids = torch.tensor([[1, 17, VISION_START, *[IMAGE_TOKEN] * 4, VISION_END, 23, 42, 7, 64]])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
        "pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


@torch.no_grad()
def logits_of(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(**qwen3_vl_inputs()).logits


@pytest.mark.parametrize(
    ("model_id", "tied"), [(None, False), ("qwen3_vl", True)], ids=["auto-untied", "model_id-tied"]
)
def test_qwen3_vl_hf_dcp_hf_round_trip_and_from_pretrained_logits(tmp_path, model_id, tied):
    original = tmp_path / "hf"
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tied)).save_pretrained(original, max_shard_size="100KB")
    (original / "tokenizer.json").write_text('{"model": "tiny"}')
    before = read_safetensors(original)
    assert len(list(original.glob("*.safetensors"))) >= 3
    assert ("lm_head.weight" in before) is not tied and any(k.startswith("model.visual.") for k in before)

    flag = [] if model_id is None else ["--model_id", model_id]
    assert mm_convert("hf_to_dcp", "--hf_dir", original, "--dcp_dir", tmp_path / "dcp", *flag) == 0
    assert (
        mm_convert(
            "dcp_to_hf",
            "--load_dir",
            tmp_path / "dcp",
            "--save_dir",
            tmp_path / "out",
            "--model_assets_dir",
            original,
            "--max_shard_size",
            "150KB",
            *flag,
        )
        == 0
    )
    assert_bit_exact(read_safetensors(tmp_path / "out"), before)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (original / name).read_bytes()

    reference = Qwen3VLForConditionalGeneration.from_pretrained(original)
    exported = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert exported.dtype == reference.dtype == torch.float32
    expected = logits_of(reference)
    assert torch.equal(logits_of(exported), expected)

    # meta-device build + the same adapter in the HF loader, and the release through load_checkpoint
    for load in (lambda m: load_hf_weights(m, original), lambda m: load_checkpoint(tmp_path / "dcp", model=m)):
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tied))
        model.to_empty(device="cpu")
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer)
        if tied:
            model.tie_weights()  # to_empty gives lm_head its own tensor again
        load(model)
        assert torch.equal(logits_of(model), expected)
