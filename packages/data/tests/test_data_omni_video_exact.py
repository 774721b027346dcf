"""Qwen3-Omni video rows give exactly what transformers' `Qwen3OmniMoeProcessor` makes of them: the same ids (the
video pads, and with `use_audio_in_video` its audio track's pads interleaved by time), `pixel_values_videos`,
`video_grid_thw`, `video_second_per_grid`, and the clips' `input_features` / `feature_attention_mask` with the
tracks among them in text order.

The reference is a user's inference code, as in `test_data_audio_exact.py` (its model directory, chat templates and
never a setting of ours): `AutoProcessor.from_pretrained`, the chat template, then the processor call with the
user's own video sampling (`fps=2`, `do_sample_frames=True`, and `max_frames` where the config sets
`video_maxlen`) — the values mmfsdp's config gives as `video_fps` / `video_maxlen`. Frames reach it as transformers'
`load_video` (PyAV backend: every frame and its metadata) reads them, so it samples them itself. A standalone WAV
clip reaches it as transformers' `load_audio` reads it; a video's audio track (AAC in the MP4) as `decode_audio`
gives it: transformers reads a track only through torchcodec, which this environment lacks, so the track is passed
as the processor's own API allows, one waveform per audio slot with `audio_from_video_indices`
(`load_audio_from_video=True`), the slots in the order the text names them. mmfsdp reads only the headers (and
each track's length) while tokenizing and decodes the frames and tracks in its workers' `video_inputs` /
`audio_inputs`.

Clips written once per module: mpeg4 and h264 (B-frames) videos of odd sizes at 10 and 29.97 fps, two with a stereo
AAC track (44.1 kHz, 3 s; 48 kHz, 1.3 s, shorter than its video), one silent (no audio stream); a WAV clip and an
image.
"""

from __future__ import annotations

import copy
import functools
import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmfsdp.config import ConfigError
from mmfsdp.data import SampleEncoder, build_dataset, decode_audio, get_collator
from mmfsdp.data.build import build_plugin

DATA = Path(__file__).parent / "data"
INSTRUCT = "qwen3_omni_instruct_chat_template.jinja"
THINKING = "qwen3_omni_thinking_chat_template.jinja"
FPS = 2.0
"""The user's video sampling: `video_fps` in mmfsdp's config, `fps` in the processor call."""
VIDEOS = {  # name: frames, width, height, fps, codec, audio (rate, seconds) or None
    "talk.mp4": (30, 40, 24, 10, "mpeg4", (44100, 3.0)),
    "ntsc.mp4": (50, 46, 28, Fraction(30000, 1001), "libx264", (48000, 1.3)),
    "silent.mp4": (20, 48, 32, 10, "mpeg4", None),
}


def _tone(rate: int, seconds: float, channels: int, seed: int) -> np.ndarray:
    n = int(rate * seconds)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    return 0.3 * np.sin(2 * np.pi * (350 + 150 * seed) * t) + rng.uniform(-0.1, 0.1, (channels, n))


@pytest.fixture(scope="module")
def media(tmp_path_factory, h) -> Path:
    out = tmp_path_factory.mktemp("omni_video_media")
    for i, (name, (frames, width, height, fps, codec, audio)) in enumerate(VIDEOS.items()):
        track = (_tone(audio[0], audio[1], 2, i), audio[0]) if audio else None
        h.write_video(out / name, frames, width, height, fps=fps, codec=codec, seed=i, audio=track)
    h.write_audio(out / "a.wav", _tone(16000, 1.1, 1, 7), 16000)
    h.write_image(out / "img.png", 60, 40, seed=0)
    with av.open(str(out / "ntsc.mp4")) as container:
        assert container.streams.video[0].codec_context.has_b_frames and container.streams.audio
    with av.open(str(out / "silent.mp4")) as container:
        assert not container.streams.audio
    return out


@functools.cache
def _inference_processor(directory: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory)


@functools.cache
def _frames(path: str):
    from transformers.video_utils import load_video

    return load_video(path, backend="pyav")


def _reference(h, directory: Path, media: Path, turns, images, videos, audios, *, in_video, template, max_frames=None):
    hf = _inference_processor(str(directory))
    text = hf.apply_chat_template(h.media_messages(turns, None), tokenize=False, chat_template=(DATA / template).read_text())
    decoded = [_frames(str(media / name)) for name in videos]
    standalone = [_load(media / name) for name in audios]
    kwargs = {"audio": standalone or None}
    if in_video and videos:  # one slot per audio in text order: a video's own track (if any) or the next clip
        slots, waves, clips, video_index = [], [], iter(standalone), 0
        for tag in re.findall(r"<(video|audio)>", "".join(user for user, _ in turns)):
            if tag == "audio":
                slots.append(None)
                waves.append(next(clips))
                continue
            path = media / videos[video_index]
            with av.open(str(path)) as container:
                if container.streams.audio:
                    slots.append(video_index)
                    waves.append(decode_audio(str(path), 16000).samples)
            video_index += 1
        kwargs = {"audio": waves or None, "audio_from_video_indices": slots, "load_audio_from_video": True}
    if max_frames is not None:
        kwargs["max_frames"] = max_frames
    return hf(
        text=[text],
        images=[Image.open(media / name).convert("RGB") for name in images] or None,
        videos=[frames for frames, _ in decoded] or None,
        video_metadata=[copy.deepcopy(metadata) for _, metadata in decoded] or None,
        fps=FPS, do_sample_frames=True, return_tensors="pt", **kwargs,
    )


def _load(path: Path) -> np.ndarray:
    from transformers.audio_utils import load_audio

    return load_audio(str(path), sampling_rate=16000, backend="soundfile")


def _config(h, processor, media, *, in_video, template="qwen3_omni_nothink", **preprocess):
    pp = {"template": template, "video_fps": FPS, "use_audio_in_video": in_video, **preprocess}
    return h.data_config(processor.name_or_path, media, preprocess=pp, attr={"videos": "videos", "audios": "audios"})


def _row(turns, images, videos, audios) -> dict:
    messages = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": list(images), "videos": list(videos), "audios": list(audios)}


def _compare(h, processor, media, turns, images=(), videos=(), audios=(), *, in_video, template="qwen3_omni_nothink",
             **preprocess):
    encoder = SampleEncoder(_config(h, processor, media, in_video=in_video, template=template, **preprocess), processor)
    sample = encoder.encode_row(_row(turns, images, videos, audios))
    reference = _reference(
        h, Path(processor.name_or_path), media, turns, images, videos, audios, in_video=in_video,
        template=INSTRUCT if template == "qwen3_omni_nothink" else THINKING,
        max_frames=preprocess.get("video_maxlen"),
    )
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    plugin = encoder.plugin
    if videos:
        pixels = plugin.video_inputs(sample["videos"], [tuple(g) for g in sample["video_grids"]])
        for key in ("video_grid_thw", "pixel_values_videos", "video_second_per_grid"):
            assert pixels[key].dtype == reference[key].dtype and torch.equal(pixels[key], reference[key]), key
    if sample["audios"]:
        features = plugin.audio_inputs(sample["audios"], [tuple(g) for g in sample["audio_grids"]])
        for key in ("input_features", "feature_attention_mask"):
            assert torch.equal(features[key], reference[key]), key
    else:
        assert "input_features" not in reference
    if images:
        pixels = plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]])
        assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    return encoder, sample


def _interleaved(ids: list[int], plugin) -> int:
    """Videos whose audio track is interleaved: `<|audio_start|>` right after `<|vision_start|>`."""
    return sum(a == plugin.start_id and b == plugin.audio_start_id for a, b in zip(ids, ids[1:]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(VIDEOS))
def test_each_video_alone(omni_processor, media, h, name):
    encoder, sample = _compare(h, omni_processor, media, [("<video>What moves?", "A square.")], videos=[name],
                               in_video=False)
    assert not sample["audios"] and _interleaved(sample["input_ids"], encoder.plugin) == 0
    end = omni_processor.token_id("<|im_end|>")
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [omni_processor.encode_texts(["A square."])[0] + [end]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["talk.mp4", "ntsc.mp4"])
def test_a_video_with_its_audio_track(omni_processor, media, h, name):
    """The track's pads interleave with the video's; its clip is the sample's only one."""
    encoder, sample = _compare(h, omni_processor, media, [("<video>What do you hear?", "A tone.")], videos=[name],
                               in_video=True)
    plugin = encoder.plugin
    assert _interleaved(sample["input_ids"], plugin) == 1 and sample["audios"] == sample["videos"]
    ids = sample["input_ids"]
    first_audio, last_video = ids.index(plugin.audio_id), len(ids) - 1 - ids[::-1].index(plugin.video_id)
    assert first_audio < last_video  # interleaved, not one run after the other
    rate, seconds = VIDEOS[name][5]
    assert sample["audio_grids"][0][3:] == [rate, 2, 1] and abs(sample["audio_grids"][0][0] - 16000 * seconds) < 1600


@pytest.mark.timeout(300)
def test_several_clips_images_and_videos_with_and_without_tracks(omni_processor, media, h):
    """Two turns: a clip, an image, a video with its track; then a silent video and a second video with its track,
    then the clip again: five clips in all, the tracks where their videos are, every clip's frames counted against
    the longest of them all."""
    turns = [
        ("<audio>Listen, look at <image> and watch <video>.", "Done."),
        ("Now <video> and <video>, then <audio> again.", "The second one is louder."),
    ]
    videos, audios = ["talk.mp4", "silent.mp4", "ntsc.mp4"], ["a.wav", "a.wav"]
    encoder, sample = _compare(h, omni_processor, media, turns, ["img.png"], videos, audios, in_video=True)
    assert _interleaved(sample["input_ids"], encoder.plugin) == 2
    assert sample["audios"] == [str(media / n) for n in ("a.wav", "talk.mp4", "ntsc.mp4", "a.wav")]
    assert [len(g) for g in sample["audio_grids"]] == [5, 6, 6, 5]  # the tracks carry their flag
    end = omni_processor.token_id("<|im_end|>")
    answers = omni_processor.encode_texts([a for _, a in turns])
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [a + [end] for a in answers]


@pytest.mark.timeout(120)
def test_without_use_audio_in_video_a_track_is_not_read(omni_processor, media, h):
    _, sample = _compare(h, omni_processor, media, [("<audio><video>?", "Yes.")], videos=["talk.mp4"], audios=["a.wav"],
                         in_video=False)
    assert sample["audios"] == [str(media / "a.wav")] and sample["video_grids"][0][9:14] == [0, 0, 0, 0, 0]


@pytest.mark.timeout(120)
def test_thinking_template_and_video_maxlen(omni_processor, media, h):
    turns = [("<video>Count the frames.", "<think>\nmany\n</think>\n\nSome.")]
    _, sample = _compare(h, omni_processor, media, turns, videos=["ntsc.mp4"], in_video=True, template="qwen3_omni",
                         video_maxlen=2)
    assert len(sample["video_grids"][0]) - 14 == 2  # two frames sampled: one temporal group


@pytest.mark.timeout(120)
def test_dataset_and_collator_keep_tracks_in_text_order(omni_processor, media, h, tmp_path):
    """Through the dataset and the `qwen3_omni` collator: `video_second_per_grid` per video, the clips' features in
    the order their pads stand (the track, then the clip), video kinds counted."""
    turns = [("<video><audio>?", "a")]
    rows = [_row(turns, [], ["talk.mp4"], ["a.wav"]), _row([("<video>?", "b")], [], ["silent.mp4"], [])]
    train = h.write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = h.data_config(
        omni_processor.name_or_path, media,
        preprocess={"template": "qwen3_omni_nothink", "video_fps": FPS, "use_audio_in_video": True},
        attr={"videos": "videos", "audios": "audios"},
        basic={"dataset": str(train), "cache_dir": str(tmp_path / "cache"), "shuffle": False},
    )
    dataset = build_dataset(cfg, omni_processor)
    assert dataset.media_kinds() == {"video", "audio"}
    items = [dataset[0], dataset[1]]
    reference = _reference(h, Path(omni_processor.name_or_path), media, turns, [], ["talk.mp4"], ["a.wav"],
                           in_video=True, template=INSTRUCT)
    assert torch.equal(items[0]["input_features"], reference["input_features"])
    assert dataset.record(0)["audios"] == [str(media / "talk.mp4"), str(media / "a.wav")]
    batch = get_collator("qwen3_omni")(pad_token_id=omni_processor.pad_token_id)(items)
    assert batch["video_second_per_grid"].tolist() == [1.0, 1.0] and batch["video_grid_thw"].shape == (2, 3)
    assert batch["input_features"].shape[0] == 2 and "mm_token_type_ids" not in batch


def test_use_audio_in_video_needs_a_plugin_that_reads_tracks(qwen_processor, media, h):
    cfg = h.data_config(qwen_processor.name_or_path, media,
                        preprocess={"template": "qwen3_vl_nothink", "use_audio_in_video": True})
    with pytest.raises(ConfigError, match="use_audio_in_video"):
        build_plugin(cfg, qwen_processor)
