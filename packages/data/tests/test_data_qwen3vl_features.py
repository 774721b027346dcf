"""For every image size, the `<|image_pad|>` tokens the qwen2_vl plugin lays out equal the features Qwen3-VL makes.

A tiny random-init `Qwen3VLForConditionalGeneration` (16-px patches, spatial merge 2,
temporal patch 2, fp32, eval) encodes the collated `pixel_values` / `image_grid_thw`;
per image, the number of feature vectors must equal the number of `<|image_pad|>`
tokens in that image's block, and the full forward — fed exactly the model inputs
of the `qwen3vl` collator's batch (every key but `labels`), which HF checks against
the features itself — must run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmfsdp.data import BadSample, SampleEncoder
from mmfsdp.data.families.qwen3_vl.collator import Qwen3VLCollator
from mmfsdp.model import model_inputs

SIZE = st.tuples(st.integers(1, 400), st.integers(1, 400))


@pytest.fixture(scope="module")
def qwen_model(qwen_processor):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tid = qwen_processor.token_id
    config = Qwen3VLConfig(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": len(qwen_processor.tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "deepstack_visual_indexes": [0, 1],
            "num_position_embeddings": 64,
        },
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval()


def _blocks(ids: list[int], image_id: int, end_id: int) -> list[int]:
    """Number of `<|image_pad|>` tokens in each image block, in order."""
    counts, current = [], 0
    for t in ids:
        current += t == image_id
        if t == end_id:
            counts.append(current)
            current = 0
    return counts


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(SIZE, min_size=1, max_size=2))
def test_image_tokens_equal_image_features(qwen_processor, qwen_model, tmp_path, h, sizes):
    # A small area bound keeps the vision tower cheap; the extreme aspect ratios still reach min/max clamping.
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink", "image_max_pixels": 128 * 128})
    encoder = SampleEncoder(cfg, qwen_processor)
    plugin = encoder.plugin
    paths = [h.write_image(tmp_path / f"q{i}_{w}x{hh}.png", w, hh, seed=i) for i, (w, hh) in enumerate(sizes)]
    row = {"messages": [{"role": "user", "content": "<image>" * len(paths) + "What shape and colour is this?"}, {"role": "assistant", "content": "a red circle"}], "images": paths}
    # HF's smart_resize refuses aspect ratios past 200: such an image is a bad row.
    if any(max(w, hh) / min(w, hh) > 200 for w, hh in sizes):
        with pytest.raises(BadSample) as bad:
            encoder.encode_row(row)
        assert bad.value.reason == "corrupt_image"
        return

    sample = encoder.encode_row(row)
    item = {"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"])}
    item.update(plugin.token_inputs(item["input_ids"]))
    item.update(plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]]))
    batch = Qwen3VLCollator(pad_token_id=qwen_processor.pad_token_id, pad_to_multiple_of=8)([item])
    inputs = model_inputs(batch)
    assert set(batch) - set(inputs) == {"labels"} and "cu_seq_lens" not in batch
    with torch.no_grad():
        features = qwen_model.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).pooler_output
        per_image = [f.shape[0] for f in features]
        expected = [g[0] * g[1] * g[2] // 4 for g in sample["image_grids"]]
        assert per_image == _blocks(sample["input_ids"], plugin.image_id, plugin.end_id) == expected
        out = qwen_model(**inputs)
    assert torch.isfinite(out.logits).all()
