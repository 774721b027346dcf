"""Audio rows give exactly what transformers' Qwen3-Omni processor makes of them: the same ids, the same audio
placeholder count per clip, the same `input_features` and `feature_attention_mask` (and, with images, pixels), and
the labels train exactly the answers.

The reference is a user's inference code: `AutoProcessor.from_pretrained` on a model directory with Qwen3-Omni's
`preprocessor_config.json` (the published values, conftest `OMNI_PREPROCESSOR`) and a tokenizer naming its media
tokens, which builds `Qwen3OmniMoeProcessor` with its own defaults (16 kHz, `n_window` 50, `padding=True`); the chat
template renders the conversation with audio and image items (`data/qwen3_omni_*_chat_template.jinja`, see its README)
and the processor expands the placeholders and computes the features. It is never given a setting of ours. Each clip
reaches it as a waveform: every WAV and FLAC clip (any rate, mono or stereo) as transformers' own
`load_audio(path, 16000)` reads it (its soundfile backend: soundfile decodes, the channels are averaged, soxr
resamples; soundfile is in the dev group), the lossy ones (MP3, Opus, AAC) as `decode_audio` gives them: another
decoder of a lossy codec gives other samples (libsndfile's MP3 and Opus decoders differ from FFmpeg's by up to 4e-3,
`test_data_audio_decode.py::test_load_audio_agrees`, which also checks the decoding against the clips' known content).

Clips of our own making, written once per module: WAV at 8, 16, 44.1 and 48 kHz (mono and stereo, one of 60 s),
FLAC, MP3, Ogg Opus and M4A AAC, 0.3 s to 60 s, lengths that are no whole number of feature hops; two images.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmfsdp.data import IGNORE_INDEX, SampleEncoder, build_dataloader, build_dataset, decode_audio, get_collator

DATA = Path(__file__).parent / "data"
INSTRUCT = "qwen3_omni_instruct_chat_template.jinja"
THINKING = "qwen3_omni_thinking_chat_template.jinja"
LOSSLESS = (".wav", ".flac")
"""Clips the reference loads with transformers' `load_audio` (module docstring)."""
CLIPS = {  # name: sample rate, channels, seconds, codec, container
    "odd.wav": (16000, 1, 1.2345, "pcm_s16le", None),
    "stereo16.wav": (16000, 2, 4.99, "pcm_s16le", None),
    "short.wav": (8000, 1, 0.3, "pcm_s16le", None),
    "cd.wav": (44100, 2, 2.5, "pcm_s16le", None),
    "minute.wav": (48000, 2, 60.0, "pcm_s16le", None),
    "a.flac": (48000, 1, 3.3, "flac", None),
    "a.mp3": (44100, 2, 1.7, "libmp3lame", None),
    "a.ogg": (48000, 1, 2.2, "libopus", "ogg"),
    "b.opus": (24000, 2, 0.95, "libopus", "ogg"),
    "a.m4a": (22050, 2, 0.9, "aac", "mp4"),
}


@pytest.fixture(scope="module")
def media(tmp_path_factory, h) -> Path:
    out = tmp_path_factory.mktemp("audio_media")
    for i, (name, (rate, channels, seconds, codec, container)) in enumerate(CLIPS.items()):
        rng = np.random.default_rng(i)
        n = int(seconds * rate)
        t = np.arange(n) / rate
        tone = 0.3 * np.sin(2 * np.pi * (300 + 200 * i) * t)
        h.write_audio(out / name, tone + rng.uniform(-0.2, 0.2, (channels, n)), rate, codec, container)
    h.write_image(out / "img0.png", 40, 70, seed=0)
    h.write_image(out / "img1.png", 300, 120, seed=1)
    return out


@functools.cache
def _inference_processor(directory: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory)


def _waveform(path: Path) -> np.ndarray:
    """A clip as the reference gets it (module docstring): transformers' `load_audio` for the lossless ones."""
    if path.suffix in LOSSLESS:
        from transformers.audio_utils import load_audio

        return load_audio(str(path), sampling_rate=16000, backend="soundfile")
    return decode_audio(str(path), 16000).samples


def _reference(h, directory: Path, media: Path, turns, images, audios, *, system=None, template=INSTRUCT):
    hf = _inference_processor(str(directory))
    text = hf.apply_chat_template(h.media_messages(turns, system), tokenize=False,
                                  chat_template=(DATA / template).read_text())
    return hf(
        text=[text],
        images=[Image.open(media / name).convert("RGB") for name in images] or None,
        audio=[_waveform(media / name) for name in audios] or None,
        return_tensors="pt",
    )


def _row(turns, images=(), audios=(), system=None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": list(images), "audios": list(audios)}


def _config(h, processor, media, template="qwen3_omni_nothink", **preprocess):
    pp = {"template": template, **preprocess}
    return h.data_config(processor.name_or_path, media, preprocess=pp, attr={"audios": "audios"})


def _pad_runs(ids: list[int], start: int, pad: int) -> list[int]:
    """The number of `pad` tokens after each `start` token."""
    counts = []
    for i, token in enumerate(ids):
        if token == start:
            j = i + 1
            while j < len(ids) and ids[j] == pad:
                j += 1
            counts.append(j - i - 1)
    return counts


def _compare(h, processor, media, turns, images=(), audios=(), *, system=None, template="qwen3_omni_nothink"):
    encoder = SampleEncoder(_config(h, processor, media, template), processor)
    sample = encoder.encode_row(_row(turns, images, audios, system))
    reference = _reference(
        h, Path(processor.name_or_path), media, turns, images, audios, system=system,
        template=INSTRUCT if template == "qwen3_omni_nothink" else THINKING,
    )
    ids = reference["input_ids"][0].tolist()
    assert sample["input_ids"] == ids
    plugin = encoder.plugin
    assert [g[2] for g in sample["audio_grids"]] == _pad_runs(ids, plugin.audio_start_id, plugin.audio_id)
    assert "mm_token_type_ids" not in reference and plugin.token_inputs(torch.tensor(ids)) == {}
    media_ids = plugin.image_token_ids
    assert all(label == IGNORE_INDEX for token, label in zip(ids, sample["labels"]) if token in media_ids)
    if audios:
        features = plugin.audio_inputs(sample["audios"], [tuple(g) for g in sample["audio_grids"]])
        for key in ("input_features", "feature_attention_mask"):
            assert features[key].dtype == reference[key].dtype and torch.equal(features[key], reference[key]), key
        assert features["feature_attention_mask"].sum(-1).tolist() == [g[1] for g in sample["audio_grids"]]
    if images:
        pixels = plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]])
        assert torch.equal(pixels["image_grid_thw"], reference["image_grid_thw"])
        assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    return encoder, sample


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [name for name in CLIPS if name != "minute.wav"])
def test_each_clip_alone(omni_processor, media, h, name):
    rate, channels, seconds = CLIPS[name][:3]
    encoder, sample = _compare(h, omni_processor, media, [("<audio>What do you hear?", "A tone in noise.")],
                               audios=[name])
    samples, frames, tokens, source_rate, source_channels = sample["audio_grids"][0]
    opus = CLIPS[name][3] == "libopus"  # an Opus stream always decodes at 48 kHz, whatever rate it was made from
    assert (source_rate, source_channels) == (48000 if opus else rate, channels)
    assert abs(samples - seconds * 16000) <= 16000 * 0.1  # lossy encoders pad their last frame
    assert frames == samples // 160  # alone, a clip is its sample's longest
    end = omni_processor.token_id("<|im_end|>")
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [
        omni_processor.encode_texts(["A tone in noise."])[0] + [end]
    ]


@pytest.mark.timeout(300)
def test_several_clips_and_images_in_a_multi_turn_conversation(omni_processor, media, h):
    """A minute-long clip beside short ones: the processor pads every clip to the longest and counts each shorter
    clip's frames as ceil(samples / hop), the longest's as samples // hop."""
    turns = [
        ("<audio><image>What is making this sound?", "A speaker."),
        ("Compare <audio> with\n<audio>, then look at <image>.", "The second is longer."),
        ("And <audio>?", "Shorter still."),
        ("Thanks!", "You're welcome."),
    ]
    audios = ["cd.wav", "minute.wav", "a.mp3", "b.opus"]
    _, sample = _compare(h, omni_processor, media, turns, ["img0.png", "img1.png"], audios, system="Be brief.")
    grids = sample["audio_grids"]
    assert grids[1][1] == grids[1][0] // 160 == 6000
    assert [g[1] for g in grids[::2]] == [math.ceil(g[0] / 160) for g in grids[::2]]
    end = omni_processor.token_id("<|im_end|>")
    answers = omni_processor.encode_texts([a for _, a in turns])
    assert h.trained_runs(sample["input_ids"], sample["labels"]) == [a + [end] for a in answers]


@pytest.mark.timeout(120)
def test_thinking_template(omni_processor, media, h):
    turns = [("<audio>Count the sounds.", "One."), ("<audio>And here?", "<think>\nlisten\n</think>\n\nTwo.")]
    _, sample = _compare(h, omni_processor, media, turns, audios=["odd.wav", "a.ogg"], template="qwen3_omni")
    assert sample["audio_grids"][0][1] == math.ceil(sample["audio_grids"][0][0] / 160)  # beside a longer clip


@pytest.mark.timeout(120)
def test_a_clips_tokens_depend_on_the_longest_clip_of_its_sample(omni_processor, media, h, tmp_path):
    """A clip of 160·k + 1 samples has k frames alone and k + 1 beside a longer clip; the token count follows."""
    plugin = SampleEncoder(_config(h, omni_processor, media), omni_processor).plugin
    k = next(k for k in range(3, 400) if plugin.num_tokens(k) != plugin.num_tokens(k + 1))
    clip = h.write_audio(media / f"k{k}.wav", np.full((1, 160 * k + 1), 0.25), 16000)
    alone = _compare(h, omni_processor, media, [("<audio>?", "a")], audios=[Path(clip).name])[1]
    beside = _compare(h, omni_processor, media, [("<audio><audio>?", "b")], audios=[Path(clip).name, "odd.wav"])[1]
    assert alone["audio_grids"][0][1:3] == [k, plugin.num_tokens(k)]
    assert beside["audio_grids"][0][1:3] == [k + 1, plugin.num_tokens(k + 1)]


def test_feature_frames_are_the_feature_extractors(omni_processor, media, h):
    """`feature_frames` against the feature extractor's own attention mask, on silent clips of random lengths
    (1 to 4 clips per call, lengths from one STFT window to 1.3 s)."""
    plugin = SampleEncoder(_config(h, omni_processor, media), omni_processor).plugin
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(400, 21000, size=rng.integers(1, 5)).tolist()
        out = plugin.feature_extractor([np.zeros(n, dtype=np.float32) for n in lengths], **plugin._audio_kwargs)
        assert plugin.feature_frames(lengths) == out["attention_mask"].sum(-1).tolist(), lengths


@pytest.mark.timeout(180)
def test_dataset_collator_and_loader_carry_the_features(omni_processor, media, h, tmp_path):
    """Audio, audio + image, image-only and text-only rows in one batch: each clip's features and mask are its sample's
    own, in sample order, zero-padded to the batch's longest clip; padded and packed layouts carry the same media."""
    rows = [
        _row([("<audio>What is it?", "A tone.")], audios=["odd.wav"]),
        _row([("<audio><image>And these <audio>?", "Two tones.")], images=["img0.png"], audios=["a.flac", "short.wav"]),
        _row([("<image>Shape?", "A square.")], images=["img1.png"]),
        _row([("Hello?", "Hi.")]),
    ]
    train = h.write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = h.data_config(
        omni_processor.name_or_path, media, preprocess={"template": "qwen3_omni_nothink"}, attr={"audios": "audios"},
        basic={"dataset": str(train), "cache_dir": str(tmp_path / "cache"), "shuffle": False},
        loader={"collate_param": {"model_name": "qwen3omni"}},
    )
    dataset = build_dataset(cfg, omni_processor)
    assert dataset.media_kinds() == {"image", "audio"}
    items = [dataset[i] for i in range(4)]
    assert [tuple(it["input_features"].shape) for it in items[:2]] == [(1, 128, 123), (2, 128, 330)]
    assert "input_features" not in items[2] and "mm_token_type_ids" not in items[0]
    collator = get_collator("qwen3_omni")(pad_token_id=omni_processor.pad_token_id)
    packed = get_collator("qwen3_omni")(pad_token_id=omni_processor.pad_token_id, packing=True)
    for batch in (collator(items), packed([items[:2], items[2:]])):
        assert "mm_token_type_ids" not in batch
        assert batch["input_features"].shape == (3, 128, 330) and batch["feature_attention_mask"].shape == (3, 330)
        clips = [(it, k) for it in items[:2] for k in range(it["input_features"].shape[0])]
        for row, (it, k) in enumerate(clips):
            frames = it["input_features"].shape[-1]
            assert torch.equal(batch["input_features"][row, :, :frames], it["input_features"][k])
            assert torch.equal(batch["feature_attention_mask"][row, :frames], it["feature_attention_mask"][k])
            assert not batch["feature_attention_mask"][row, frames:].any()
        assert torch.equal(batch["image_grid_thw"], torch.cat([items[1]["image_grid_thw"], items[2]["image_grid_thw"]]))
    grids = [g for i in range(2) for g in dataset.record(i)["audio_grids"]]
    assert collator(items)["feature_attention_mask"].sum(-1).tolist() == [g[1] for g in grids]
    loader = build_dataloader(dataset, cfg, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0)
    batch = next(iter(loader))
    assert batch["input_features"].shape == (3, 128, 330) and batch["pixel_values"].shape[0] > 0
