"""Video data against the tiny `qwen3_vl` model: token counts equal the vision tower's features; the training forward
on a collated video + image + text-only batch equals plain HF `labels=`; packed video samples equal separate runs.

The model is `get_model_entry("qwen3_vl").testkit.tiny_config()` with the test tokenizer's vocabulary and media
token ids (16-px patches, merge 2, temporal patch 2, like the plugin's processors), fp32 on CPU. Clips are written
at test time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmfsdp.data import SampleEncoder, build_dataset, get_collator
from mmfsdp.model import compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.qwen3_vl.model import mm_token_types
from mmfsdp.model.testing import assert_close, model_inputs, model_pair

TOL = 1e-5


def _row(user, videos=(), images=(), answer="It moves right."):
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        "videos": list(videos),
        "images": list(images),
    }


@pytest.fixture(scope="module")
def tiny_config(qwen_processor):
    tid = qwen_processor.token_id
    config = get_model_entry("qwen3_vl").testkit.tiny_config(
        vocab_size=len(qwen_processor.tokenizer),
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
    )
    vision = config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    return config


@pytest.fixture(scope="module")
def pair(tiny_config):
    ours, reference = model_pair(tiny_config)
    return ours.eval(), reference.eval()


@pytest.fixture(scope="module")
def encoder(qwen_processor, h, tmp_path_factory):
    out = tmp_path_factory.mktemp("video_model")
    cfg = h.data_config(
        qwen_processor.name_or_path,
        out,
        preprocess={"template": "qwen3_vl_nothink", "video_fps": 4.0, "video_maxlen": 9},
        attr={"videos": "videos"},
    )
    return SampleEncoder(cfg, qwen_processor), out


@pytest.mark.timeout(300)
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    num_frames=st.integers(2, 14),
    width=st.integers(20, 100),
    height=st.integers(20, 100),
    fps=st.sampled_from([5, 8, 12]),
)
def test_video_tokens_equal_the_vision_tower_features(encoder, pair, h, num_frames, width, height, fps):
    encoder, out = encoder
    width, height = width // 2 * 2, height // 2 * 2  # yuv420p needs even sides
    name = f"p{num_frames}_{width}x{height}_{fps}.mp4"
    h.write_video(out / name, num_frames, width, height, fps=fps)
    sample = encoder.encode_row(_row("<video>Which way?", [name]))
    grid = tuple(sample["video_grids"][0])
    inputs = encoder.plugin.video_inputs(sample["videos"], [grid])
    with torch.no_grad():
        features = pair[1].model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    embeds = features.pooler_output if hasattr(features, "pooler_output") else features[0]
    num_features = sum(e.shape[0] for e in embeds) if isinstance(embeds, (list, tuple)) else embeds.shape[0]
    assert sample["input_ids"].count(encoder.plugin.video_id) == num_features
    t, gh, gw = grid[:3]
    assert num_features == t * gh * gw // 4 and len(grid) - 9 == min(max(int(num_frames / fps * 4), 4), 9, num_frames)


@pytest.fixture(scope="module")
def items(qwen_processor, h, tmp_path_factory):
    out = tmp_path_factory.mktemp("video_batch")
    h.write_video(out / "a.mp4", 12, 48, 32, fps=8)
    h.write_video(out / "b.mp4", 9, 40, 64, fps=6, seed=1)
    h.write_image(out / "img.png", 40, 70)
    rows = [
        _row("<video>Which way does it move?", ["a.mp4"]),
        _row("<image>What is this?", images=["img.png"], answer="Noise."),
        _row("Hello there", answer="Hi."),
        _row("<image> then <video>", ["b.mp4"], ["img.png"], answer="Both."),
    ]
    cfg = h.data_config(
        qwen_processor.name_or_path,
        out,
        preprocess={"template": "qwen3_vl_nothink", "video_fps": 4.0, "video_maxlen": 9},
        attr={"videos": "videos"},
        basic={"dataset": str(h.write_jsonl(out / "train.jsonl", rows))},
    )
    dataset = build_dataset(cfg, qwen_processor)
    return [dataset[i] for i in range(len(dataset))]


def _train_forward(model, batch, weights=None):
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    if weights is None:
        (weights,) = compute_loss_weights([targets])
    model.zero_grad(set_to_none=True)
    return model(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss.detach()


@pytest.mark.timeout(300)
def test_training_forward_on_video_image_and_text_rows_equals_hf_labels_loss(qwen_processor, tiny_config, pair, items):
    ours, reference = pair
    batch = get_collator("qwen3vl")(pad_token_id=qwen_processor.pad_token_id)(items[:3])
    assert {"pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"} <= set(batch)
    types = mm_token_types(batch["input_ids"], tiny_config.image_token_id, tiny_config.video_token_id)
    assert torch.equal(types, batch["mm_token_type_ids"]) and int((types == 2).sum()) > 0
    with torch.no_grad():
        expected = reference(**model_inputs(batch), labels=batch["labels"]).loss
        loss = _train_forward(ours, batch)
    assert_close(loss, expected, TOL, "loss")


@pytest.mark.timeout(300)
def test_packed_video_samples_equal_separate_runs(qwen_processor, pair, items):
    """M-RoPE restarts per sample with each sample's own video and image grids taken in order."""
    ours, _ = pair
    collate = get_collator("qwen3vl")
    packed = collate(pad_token_id=qwen_processor.pad_token_id, packing=True)(
        [[items[1], items[0], items[3]], [items[2]]]
    )

    def summed(batch):
        return (shift_labels(batch["labels"], batch.get("cu_seq_lens")) != -100).float()

    with torch.no_grad():
        loss = _train_forward(ours, packed, summed(packed))
        expected = sum(
            _train_forward(ours, alone, summed(alone))
            for alone in (collate(pad_token_id=qwen_processor.pad_token_id)([item]) for item in items)
        )
    assert_close(loss, expected, TOL, "loss")
