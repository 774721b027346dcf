"""Video rows give exactly HF `Qwen3VLProcessor`'s ids, `mm_token_type_ids`, `pixel_values_videos` and `video_grid_thw`.

Reference: the official Qwen3-VL chat template renders the conversation (video items as
`<|vision_start|><|video_pad|><|vision_end|>`), then `Qwen3VLProcessor` — a real
`Qwen3VLVideoProcessor` set like the image processor (16-px patches, merge 2, temporal
patch 2), sampling at `video_fps` with `max_frames = video_maxlen` — gets *every* frame of
each clip (decoded here with PyAV) and its metadata, so HF samples the frames, stamps the
temporal groups and processes the pixels itself. mmfsdp reads only the headers while
tokenizing and decodes only the sampled frames in `pixel_inputs`. Clips are written at test
time: a square moving over noise, 9–20 frames, 40–64 px.
"""

from __future__ import annotations

import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmfsdp.data import SampleEncoder, build_dataset, get_collator

DATA = Path(__file__).parent / "data"
INSTRUCT = "qwen3_vl_instruct_chat_template.jinja"
THINKING = "qwen3_vl_thinking_chat_template.jinja"
VIDEO_FPS, VIDEO_MAXLEN = 4.0, 7
CLIPS = {"a.mp4": (12, 48, 32, 8), "b.mp4": (20, 64, 40, 10), "c.mp4": (9, 40, 56, 6)}  # frames, width, height, fps


@pytest.fixture(scope="module")
def media(tmp_path_factory, h) -> Path:
    out = tmp_path_factory.mktemp("video_media")
    for i, (name, (frames, width, height, fps)) in enumerate(CLIPS.items()):
        h.write_video(out / name, frames, width, height, fps=fps, seed=i)
    h.write_image(out / "img0.png", 40, 70, seed=0)
    h.write_image(out / "img1.png", 64, 64, seed=1)
    return out


def _all_frames(path: Path):
    """Every frame of a clip and HF's metadata for it, the way HF's own PyAV reader builds them."""
    from transformers.video_utils import VideoMetadata

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    n, height, width = frames.shape[:3]
    return frames, VideoMetadata(total_num_frames=n, fps=fps, width=width, height=height, duration=n / fps)


def _resized(frames: np.ndarray, max_pixels: int) -> np.ndarray:
    """LLaMA-Factory's per-frame pre-resize: scale by sqrt(max / area), sides truncated, bicubic."""
    height, width = frames.shape[1:3]
    if width * height <= max_pixels:
        return frames
    factor = math.sqrt(max_pixels / (width * height))
    size = (int(width * factor), int(height * factor))
    return np.stack([np.asarray(Image.fromarray(f).resize(size, Image.Resampling.BICUBIC)) for f in frames])


def _reference(processor, media: Path, turns, images, videos, *, system=None, template=INSTRUCT, frame_max_pixels=None):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor.from_pretrained(processor.name_or_path)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        fps=VIDEO_FPS,
        max_frames=VIDEO_MAXLEN,
    )
    hf = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=processor.tokenizer,
        video_processor=video_processor,
        chat_template=(DATA / template).read_text(),
    )
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    for user, assistant in turns:
        content = []
        for piece in user.replace("<video>", "\0<video>\0").replace("<image>", "\0<image>\0").split("\0"):
            if piece in ("<image>", "<video>"):
                content.append({"type": piece[1:-1]})
            elif piece:
                content.append({"type": "text", "text": piece})
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": assistant}]},
        ]
    text = hf.apply_chat_template(messages, tokenize=False)
    decoded = [_all_frames(media / name) for name in videos]
    frames = [_resized(f, frame_max_pixels) if frame_max_pixels else f for f, _ in decoded]
    kwargs = {}
    if "cap_pixels_per_frame" in getattr(Qwen3VLVideoProcessor.valid_kwargs, "__annotations__", {}):
        kwargs["cap_pixels_per_frame"] = False
    return hf(
        text=[text],
        images=[Image.open(media / name).convert("RGB") for name in images] or None,
        videos=frames or None,
        video_metadata=[m for _, m in decoded] or None,
        do_sample_frames=True,
        return_tensors="pt",
        **kwargs,
    )


def _row(turns, images, videos, system=None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": images, "videos": videos}


def _config(h, processor, media, template="qwen3_vl_nothink", basic=None, **preprocess):
    pp = {"template": template, "video_fps": VIDEO_FPS, "video_maxlen": VIDEO_MAXLEN, **preprocess}
    return h.data_config(processor.name_or_path, media, preprocess=pp, attr={"videos": "videos"}, basic=basic or {})


def _compare(
    h,
    processor,
    media,
    turns,
    images=(),
    videos=(),
    *,
    system=None,
    template="qwen3_vl_nothink",
    frame_max_pixels=None,
    **preprocess,
):
    cfg = _config(h, processor, media, template, **preprocess)
    encoder = SampleEncoder(cfg, processor)
    sample = encoder.encode_row(_row(turns, list(images), list(videos), system))
    hf_template = INSTRUCT if template == "qwen3_vl_nothink" else THINKING
    reference = _reference(
        processor, media, turns, images, videos, system=system, template=hf_template, frame_max_pixels=frame_max_pixels
    )
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    token_types = encoder.plugin.token_inputs(torch.tensor(sample["input_ids"]))["mm_token_type_ids"]
    assert torch.equal(token_types, torch.as_tensor(reference["mm_token_type_ids"][0]).long())
    if videos:
        pixels = encoder.plugin.video_inputs(sample["videos"], [tuple(g) for g in sample["video_grids"]])
        assert torch.equal(pixels["video_grid_thw"], reference["video_grid_thw"])
        assert torch.equal(pixels["pixel_values_videos"], reference["pixel_values_videos"])
    if images:
        pixels = encoder.plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]])
        assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    return encoder, sample


@pytest.mark.timeout(120)
def test_one_video(qwen_processor, media, h):
    encoder, sample = _compare(
        h, qwen_processor, media, [("<video>Which way does the square move?", "Right.")], videos=["a.mp4"]
    )
    grid = sample["video_grids"][0]
    assert grid[:3] == [3, 2, 4] and grid[9:] == [0, 2, 4, 7, 9, 11]  # 12 frames at 8 fps sampled at 4 fps: 6 frames
    assert sum(t == encoder.plugin.video_id for t in sample["input_ids"]) == 3 * 2 * 4 // 4
    assert all(
        label == -100 for t, label in zip(sample["input_ids"], sample["labels"]) if t in encoder.plugin.image_token_ids
    )


@pytest.mark.timeout(120)
def test_two_videos_of_different_lengths_and_sizes(qwen_processor, media, h):
    _, sample = _compare(
        h, qwen_processor, media, [("First <video> then <video>: same motion?", "Yes.")], videos=["b.mp4", "c.mp4"]
    )
    assert [len(g) - 9 for g in sample["video_grids"]] == [
        7,
        6,
    ]  # b capped by video_maxlen (odd: the last group repeats)
    assert sample["video_grids"][0][:3] != sample["video_grids"][1][:3]


@pytest.mark.timeout(120)
def test_videos_and_images_in_a_multi_turn_conversation(qwen_processor, media, h):
    turns = [
        ("<image>Describe this.", "Noise."),
        ("Now <video> and <image> together.", "A square moves over noise."),
        ("And this one? <video>", "It moves right.\n"),
    ]
    _compare(
        h,
        qwen_processor,
        media,
        turns,
        images=["img0.png", "img1.png"],
        videos=["a.mp4", "c.mp4"],
        system="Answer briefly.",
    )


@pytest.mark.timeout(120)
def test_thinking_template_multi_turn(qwen_processor, media, h):
    turns = [("<video>What moves?", "A square."), ("Which way?", "<think>\nx grows\n</think>\n\nRight.")]
    _compare(h, qwen_processor, media, turns, videos=["b.mp4"], template="qwen3_vl")


@pytest.mark.timeout(120)
def test_video_max_pixels_scales_each_frame_before_the_video_processor(qwen_processor, media, h):
    _, sample = _compare(
        h, qwen_processor, media, [("<video>?", "ok")], videos=["b.mp4"], frame_max_pixels=1200, video_max_pixels=1200
    )
    assert sample["video_grids"][0][5:7] == [43, 27]


@pytest.mark.timeout(120)
def test_video_total_pixels_shares_the_budget_over_the_sample_frames(qwen_processor, media, h):
    budget = 13 * 600  # 6 + 7 sampled frames
    _, sample = _compare(
        h,
        qwen_processor,
        media,
        [("<video><video>?", "ok")],
        videos=["a.mp4", "b.mp4"],
        frame_max_pixels=600,
        video_total_pixels=budget,
    )
    assert all(g[5] * g[6] <= 600 for g in sample["video_grids"])


@pytest.mark.timeout(180)
def test_dataset_and_collator_carry_video_inputs(qwen_processor, media, h, tmp_path):
    rows = [
        _row([("<video>What moves?", "A square.")], [], ["a.mp4"]),
        _row([("<image>And here?", "Noise.")], ["img0.png"], []),
        _row([("Hello", "Hi.")], [], []),
        _row([("<video><image>Both?", "Yes.")], ["img1.png"], ["c.mp4"]),
    ]
    cfg = _config(
        h,
        qwen_processor,
        media,
        basic={"dataset": str(h.write_jsonl(tmp_path / "train.jsonl", rows)), "cache_dir": str(tmp_path / "cache")},
    )
    dataset = build_dataset(cfg, qwen_processor)
    assert len(dataset) == 4
    assert dataset.media_kinds() == {"image", "video"}
    items = [dataset[i] for i in range(4)]
    assert set(items[0]) >= {"pixel_values_videos", "video_grid_thw"} and "pixel_values_videos" not in items[1]
    collator = get_collator("qwen3vl")(pad_token_id=qwen_processor.pad_token_id)
    batch = collator(items)
    assert torch.equal(batch["video_grid_thw"], torch.cat([items[0]["video_grid_thw"], items[3]["video_grid_thw"]]))
    assert torch.equal(
        batch["pixel_values_videos"], torch.cat([items[0]["pixel_values_videos"], items[3]["pixel_values_videos"]])
    )
    assert torch.equal(batch["image_grid_thw"], torch.cat([items[1]["image_grid_thw"], items[3]["image_grid_thw"]]))
    assert int((batch["mm_token_type_ids"] == 2).sum()) == sum(
        int((it["mm_token_type_ids"] == 2).sum()) for it in items
    )
    packed = get_collator("qwen3vl")(pad_token_id=qwen_processor.pad_token_id, packing=True)([items])
    assert torch.equal(packed["video_grid_thw"], batch["video_grid_thw"]) and packed["input_ids"].shape[0] == 1


@pytest.mark.timeout(120)
def test_mm_data_inspect_shows_each_videos_frame_times_grid_and_tokens(qwen_processor, media, h, tmp_path, capsys):
    import json

    import yaml

    from mmfsdp.data.cli import main

    rows = [_row([("<image>and <video>: what moves?", "The square.")], ["img0.png"], ["a.mp4"])]
    data = {
        "dataset_param": {
            "preprocess_parameters": {
                "model_name_or_path": qwen_processor.name_or_path,
                "template": "qwen3_vl_nothink",
                "video_fps": VIDEO_FPS,
                "video_maxlen": VIDEO_MAXLEN,
            },
            "basic_parameters": {
                "dataset_dir": str(media),
                "dataset": str(h.write_jsonl(tmp_path / "rows.jsonl", rows)),
                "cache_dir": str(tmp_path / "cache"),
            },
            "attr": {"videos": "videos"},
        },
        "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "qwen3vl"}},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": data}))
    assert main(["inspect", str(config)]) == 0
    out = capsys.readouterr().out
    times = "6 frames at 0.00, 0.25, 0.50, 0.88, 1.12, 1.38 s (48x32 px)"
    assert f"video 0: {media / 'a.mp4'}: {times} -> grid 3x2x4 patches -> 6 <|video_pad|> in 3 groups" in out
    assert (
        "<video 3x2x4 6 frames>What moves" not in out and "<image 1x4x2>and <video 3x2x4 6 frames>: what moves?" in out
    )
    assert main(["inspect", str(config), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["video_grids"][0][:3] == [3, 2, 4] and shown["video_frame_times"][0][-1] == 11 / 8
