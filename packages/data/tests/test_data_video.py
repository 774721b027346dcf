"""Video rows give exactly what transformers' own Qwen3-VL processor makes of them at inference: the same ids,
`mm_token_type_ids`, `pixel_values_videos` and `video_grid_thw`.

The reference is a user's inference code: `AutoProcessor.from_pretrained` on a model directory that holds
Qwen3-VL's processor files (`data/qwen3_vl_processor/`: sampling at fps 2, 4 to 768 frames) beside a tokenizer;
each clip decoded by transformers' `load_video` (PyAV backend: every frame and its metadata) — a WebM, whose
header has no frame count for `load_video`, by decoding every frame with PyAV — and handed to the processor, which
samples the frames itself (its own `fps`, `min_frames`, `max_frames`), stamps the temporal groups and processes
the pixels. The reference is never given a sampling setting: mmfsdp's config leaves `video_fps` and
`video_maxlen` null (the model directory's values), or sets them where the reference reads a directory whose
video processor holds the same values. mmfsdp reads only the headers while tokenizing and decodes only the
sampled frames in `video_inputs`.

Clips, written once per session at low resolution: 70 s at 4 fps (140 frames sampled, more than the 128 that
LLaMA-Factory's `video_maxlen` default keeps), h264 with B-frames at 29.97 fps, odd-sized mpeg4, an odd-sized
VP9 WebM and two short mpeg4 clips; a square moves over noise in each.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmfsdp.data import SampleEncoder, build_dataset, build_processor, get_collator, media_settings

DATA = Path(__file__).parent / "data"
INSTRUCT = "qwen3_vl_instruct_chat_template.jinja"
THINKING = "qwen3_vl_thinking_chat_template.jinja"
CLIPS = {  # name: frames, width, height, fps, codec
    "long.mp4": (280, 32, 24, 4, "mpeg4"),
    "ntsc.mp4": (100, 46, 28, Fraction(30000, 1001), "libx264"),  # x264's defaults use B-frames
    "odd.mp4": (30, 45, 27, 10, "mpeg4"),
    "odd.webm": (25, 37, 29, 10, "libvpx-vp9"),
    "a.mp4": (12, 48, 32, 8, "mpeg4"),
    "b.mp4": (20, 64, 40, 10, "mpeg4"),
}
TUNED = {"fps": 4, "max_frames": 7}
"""A user's own video sampling, in the tuned directory's `video_preprocessor_config.json`."""


@pytest.fixture(scope="session")
def media(tmp_path_factory, h) -> Path:
    out = tmp_path_factory.mktemp("video_media")
    for i, (name, (frames, width, height, fps, codec)) in enumerate(CLIPS.items()):
        h.write_video(out / name, frames, width, height, fps=fps, codec=codec, seed=i)
    h.write_image(out / "img0.png", 40, 70, seed=0)
    h.write_image(out / "img1.png", 64, 64, seed=1)
    with av.open(str(out / "ntsc.mp4")) as container:
        assert container.streams.video[0].codec_context.has_b_frames
    with av.open(str(out / "odd.webm")) as container:
        assert not container.streams.video[0].frames  # the header has no frame count
    return out


def _model_dir(out: Path, qwen_dir: Path, **video: object) -> Path:
    """The tokenizer of `qwen_dir` and the Qwen3-VL processor files, the video settings replaced by `video`."""
    shutil.copytree(qwen_dir, out, dirs_exist_ok=True)
    for file in (DATA / "qwen3_vl_processor").iterdir():
        shutil.copy(file, out / file.name)
    settings = json.loads((out / "video_preprocessor_config.json").read_text())
    (out / "video_preprocessor_config.json").write_text(json.dumps({**settings, **video}))
    return out


@pytest.fixture(scope="session")
def model_dir(qwen_dir, tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("qwen3_vl_published"), qwen_dir)


@pytest.fixture(scope="session")
def tuned_dir(qwen_dir, tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("qwen3_vl_tuned"), qwen_dir, **TUNED)


@pytest.fixture(scope="session")
def processor(model_dir, tmp_path_factory, h):
    return build_processor(
        h.data_config(model_dir, tmp_path_factory.mktemp("unused"), preprocess={"template": "qwen3_vl_nothink"})
    )


@functools.cache
def _inference_processor(directory: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory)


@functools.cache
def _decoded(path: str):
    """Every frame of a clip and its metadata: transformers' `load_video`, or for a WebM (no frame count in its
    header, so `load_video` reads none) PyAV's frames, counted."""
    from transformers.video_utils import VideoMetadata, load_video

    if not path.endswith(".webm"):
        return load_video(path, backend="pyav")
    with av.open(path) as container:
        fps = float(container.streams.video[0].average_rate)
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


def _reference(h, directory: Path, media: Path, turns, images, videos, *, system=None, template=INSTRUCT,
               frame_max_pixels=None):
    import copy

    hf = _inference_processor(str(directory))
    messages = h.media_messages(turns, system)
    text = hf.apply_chat_template(messages, tokenize=False, chat_template=(DATA / template).read_text())
    decoded = [_decoded(str(media / name)) for name in videos]
    frames = [_resized(f, frame_max_pixels) if frame_max_pixels else f for f, _ in decoded]
    return hf(
        text=[text],
        images=[Image.open(media / name).convert("RGB") for name in images] or None,
        videos=frames or None,
        video_metadata=[copy.deepcopy(m) for _, m in decoded] or None,  # the processor writes its sampling into it
        return_tensors="pt",
    )


def _row(turns, images, videos, system=None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": images, "videos": videos}


def _config(h, processor, media, template="qwen3_vl_nothink", basic=None, **preprocess):
    pp = {"template": template, **preprocess}
    return h.data_config(processor.name_or_path, media, preprocess=pp, attr={"videos": "videos"}, basic=basic or {})


def _compare(h, processor, media, turns, images=(), videos=(), *, system=None, template="qwen3_vl_nothink",
             reference_dir=None, frame_max_pixels=None, **preprocess):
    cfg = _config(h, processor, media, template, **preprocess)
    encoder = SampleEncoder(cfg, processor)
    sample = encoder.encode_row(_row(turns, list(images), list(videos), system))
    reference = _reference(
        h, reference_dir or Path(processor.name_or_path), media, turns, images, videos, system=system,
        template=INSTRUCT if template == "qwen3_vl_nothink" else THINKING, frame_max_pixels=frame_max_pixels,
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
def test_a_70_second_clip_samples_what_inference_samples(processor, media, h):
    encoder, sample = _compare(h, processor, media, [("<video>Where is it?", "Right.")], videos=["long.mp4"])
    frames = sample["video_grids"][0][9:]
    assert len(frames) == 140 and frames[-1] == 279  # 70 s at fps 2, over the 128 LLaMA-Factory's default keeps
    assert encoder.plugin.group_times(tuple(sample["video_grids"][0]))[-1] > 69


@pytest.mark.timeout(120)
def test_several_videos_and_images_in_a_multi_turn_conversation(processor, media, h):
    turns = [
        ("<image>Describe this.", "Noise."),
        ("Now <video> and <image> together.", "A square moves over noise."),
        ("And these? <video><video>", "They move right.\n"),
        ("Last: <video>", "Same."),
    ]
    _, sample = _compare(
        h, processor, media, turns, images=["img0.png", "img1.png"],
        videos=["odd.mp4", "ntsc.mp4", "odd.webm", "a.mp4"], system="Answer briefly.",
    )
    # 3 s at 10 fps, 100 frames at 29.97 fps, 2.5 s at 10 fps, 1.5 s at 8 fps (min_frames 4)
    assert [len(g) - 9 for g in sample["video_grids"]] == [6, 6, 5, 4]
    assert [tuple(g[3:5]) for g in sample["video_grids"]] == [(45, 27), (46, 28), (37, 29), (48, 32)]


@pytest.mark.timeout(120)
def test_thinking_template_multi_turn(processor, media, h):
    turns = [("<video>What moves?", "A square."), ("Which way?", "<think>\nx grows\n</think>\n\nRight.")]
    _compare(h, processor, media, turns, videos=["b.mp4"], template="qwen3_vl")


@pytest.mark.timeout(120)
def test_explicit_video_fps_and_maxlen_win_over_the_model_directory(processor, media, h, tuned_dir):
    _, sample = _compare(
        h, processor, media, [("First <video> then <video>: same motion?", "Yes.")], videos=["b.mp4", "a.mp4"],
        reference_dir=tuned_dir, video_fps=TUNED["fps"], video_maxlen=TUNED["max_frames"],
    )
    assert [len(g) - 9 for g in sample["video_grids"]] == [7, 6]  # b capped by max_frames (odd: the last group repeats)


@pytest.mark.timeout(120)
def test_video_max_pixels_scales_each_frame_before_the_video_processor(processor, media, h):
    _, sample = _compare(
        h, processor, media, [("<video>?", "ok")], videos=["b.mp4"], frame_max_pixels=1200, video_max_pixels=1200
    )
    assert sample["video_grids"][0][5:7] == [43, 27]


@pytest.mark.timeout(120)
def test_video_total_pixels_shares_the_budget_over_the_sample_frames(processor, media, h):
    budget = 8 * 600  # 4 + 4 sampled frames
    _, sample = _compare(
        h, processor, media, [("<video><video>?", "ok")], videos=["a.mp4", "b.mp4"], frame_max_pixels=600,
        video_total_pixels=budget,
    )
    assert [len(g) - 9 for g in sample["video_grids"]] == [4, 4]
    assert all(g[5] * g[6] <= 600 for g in sample["video_grids"])


def test_media_settings_name_where_each_value_came_from(processor, qwen_processor, media, h, tmp_path):
    published = {s.key: (s.value, s.source) for s in media_settings(_config(h, processor, media), processor)}
    assert published["video_fps"] == (2, "model directory: video_preprocessor_config.json")
    assert published["video_maxlen"] == (768, "model directory: video_preprocessor_config.json")
    assert published["video_processor.min_frames"] == (4, "model directory: video_preprocessor_config.json")
    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
    assert published["video_processor.size"] == (size, "transformers default (Qwen3VLVideoProcessor.size)")
    assert published["image_max_pixels"] == (28 * 28 * 1280, "transformers default (Qwen2VLImageProcessor.size)")
    assert published["video_max_pixels"][0] is None
    explicit = _config(h, processor, media, video_fps=1.5, image_min_pixels=4096)
    given = {s.key: (s.value, s.source) for s in media_settings(explicit, processor)}
    assert given["video_fps"] == (1.5, "config") and given["image_min_pixels"] == (4096, "config")
    # transformers 5 saves both processors as sections of processor_config.json: the same settings, read there
    saved = tmp_path / "saved_by_transformers_5"
    processor.hf_processor.save_pretrained(str(saved))
    assert not (saved / "preprocessor_config.json").exists()
    again = build_processor(h.data_config(saved, tmp_path, preprocess={"template": "qwen3_vl_nothink"}))
    resaved = {s.key: (s.value, s.source) for s in media_settings(_config(h, again, media), again)}
    assert {key: value for key, (value, _) in resaved.items()} == {key: value for key, (value, _) in published.items()}
    assert resaved["video_maxlen"] == (768, "model directory: processor_config.json (video_processor)")
    assert resaved["image_max_pixels"][1] == "model directory: processor_config.json (image_processor)"
    # the older test directory has no video_preprocessor_config.json: transformers reads preprocessor_config.json
    older = {s.key: (s.value, s.source) for s in media_settings(_config(h, qwen_processor, media), qwen_processor)}
    assert older["video_fps"] == (2, "transformers default (Qwen3VLVideoProcessor.fps)")
    assert older["video_processor.size"] == (
        {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}, "model directory: preprocessor_config.json"
    )


@pytest.mark.timeout(180)
def test_dataset_and_collator_carry_video_inputs(processor, media, h, tmp_path):
    rows = [
        _row([("<video>What moves?", "A square.")], [], ["a.mp4"]),
        _row([("<image>And here?", "Noise.")], ["img0.png"], []),
        _row([("Hello", "Hi.")], [], []),
        _row([("<video><image>Both?", "Yes.")], ["img1.png"], ["odd.webm"]),
    ]
    cfg = _config(
        h, processor, media,
        basic={"dataset": str(h.write_jsonl(tmp_path / "train.jsonl", rows)), "cache_dir": str(tmp_path / "cache")},
    )
    dataset = build_dataset(cfg, processor)
    assert len(dataset) == 4
    assert dataset.media_kinds() == {"image", "video"}
    items = [dataset[i] for i in range(4)]
    assert set(items[0]) >= {"pixel_values_videos", "video_grid_thw"} and "pixel_values_videos" not in items[1]
    collator = get_collator("qwen3vl")(pad_token_id=processor.pad_token_id)
    batch = collator(items)
    assert torch.equal(batch["video_grid_thw"], torch.cat([items[0]["video_grid_thw"], items[3]["video_grid_thw"]]))
    assert torch.equal(
        batch["pixel_values_videos"], torch.cat([items[0]["pixel_values_videos"], items[3]["pixel_values_videos"]])
    )
    assert torch.equal(batch["image_grid_thw"], torch.cat([items[1]["image_grid_thw"], items[3]["image_grid_thw"]]))
    assert int((batch["mm_token_type_ids"] == 2).sum()) == sum(
        int((it["mm_token_type_ids"] == 2).sum()) for it in items
    )
    packed = get_collator("qwen3vl")(pad_token_id=processor.pad_token_id, packing=True)([items])
    assert torch.equal(packed["video_grid_thw"], batch["video_grid_thw"]) and packed["input_ids"].shape[0] == 1


@pytest.mark.timeout(120)
def test_mm_data_inspect_shows_each_videos_frames_and_the_settings_sources(processor, media, h, tmp_path, capsys):
    import yaml

    from mmfsdp.data.cli import main

    rows = [_row([("<image>and <video>: what moves?", "The square.")], ["img0.png"], ["a.mp4"])]
    data = {
        "dataset_param": {
            "preprocess_parameters": {
                "model_name_or_path": processor.name_or_path, "template": "qwen3_vl_nothink", "video_maxlen": 6,
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
    # 12 frames at 8 fps sampled at fps 2: 3, raised to min_frames 4; upscaled to the video processor's size
    times = "4 frames at 0.00, 0.50, 0.88, 1.38 s (48x32 px)"
    assert f"video 0: {media / 'a.mp4'}: {times} -> grid 2x10x14 patches -> 70 <|video_pad|> in 2 groups" in out
    assert "<image 1x6x4>and <video 2x10x14 4 frames>: what moves?" in out
    assert f"  {'video_fps':<36} 2 (model directory: video_preprocessor_config.json)" in out
    assert f"  {'video_maxlen':<36} 6 (config)" in out
    assert main(["inspect", str(config), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["video_grids"][0][:3] == [2, 10, 14] and shown["video_frame_times"][0][-1] == 11 / 8
    assert shown["media_settings"]["video_maxlen"] == {"value": 6, "source": "config"}
