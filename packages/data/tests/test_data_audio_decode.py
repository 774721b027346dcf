"""Audio decoding (`mmfsdp.data.audio.decode_audio`, PyAV) against clips of known content, and bad audio as counted
bad rows with their reasons (strict: file, row and reason), never a crash or a hang.

Two references. transformers' `load_audio` (its soundfile backend; its `torchcodec` one needs FFmpeg's shared
libraries on the system, which this machine lacks): lossless clips decode to its samples bit for bit, lossy ones to
its sample count and within its decoders' difference (`test_load_audio_agrees`). And the content itself, the clips
being written from known samples:

- 16 kHz PCM WAV decodes to exactly its 16-bit samples / 32768, a stereo one to exactly the mean of its channels;
- a resampled clip (8, 22.05, 44.1 and 48 kHz; WAV and FLAC) of two tones (440 Hz and 1 kHz, well inside the
  8 kHz band) equals the tones evaluated at 16 kHz to 1e-3, one sample per 16 kHz period of its length;
- lossy clips (MP3, Ogg Opus, M4A AAC) keep the tones at over 20 dB signal-to-noise ratio, aligned (the encoders'
  priming is trimmed by FFmpeg from the MP3 Xing header, the Ogg pre-skip and the MP4 edit list).
"""

from __future__ import annotations

import dataclasses
import wave

import numpy as np
import pytest

from mmfsdp.data import BadSample, DataError, SampleEncoder, build_dataset
from mmfsdp.data import audio as audio_module
from mmfsdp.data.audio import decode_audio

RATE = 16000
TONES = ((440.0, 0.5, 0.0), (1000.0, 0.3, 0.3))
"""(Hz, amplitude, phase) of each channel's tone: channel 0 plays the first, channel 1 the second."""


def _tones(num_samples: int, rate: int, channels: int) -> np.ndarray:
    t = np.arange(num_samples) / rate
    return np.stack([amp * np.sin(2 * np.pi * hz * t + phase) for hz, amp, phase in TONES[:channels]])


def _expected(num_samples: int, channels: int) -> np.ndarray:
    """The clip's content at 16 kHz, mono (the mean of its channels)."""
    return _tones(num_samples, RATE, channels).mean(axis=0)


def _snr_db(signal: np.ndarray, reference: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(reference**2) / np.mean((signal - reference) ** 2)))


@pytest.mark.parametrize("channels", [1, 2])
def test_16khz_wav_decodes_to_its_samples(tmp_path, h, channels):
    rng = np.random.default_rng(channels)
    pcm = rng.integers(-32767, 32768, size=(channels, 12345)).astype(np.int16)
    path = h.write_audio(tmp_path / "a.wav", pcm / 32767, RATE)  # written back as the same 16-bit integers
    clip = decode_audio(path, RATE)
    assert (clip.source_rate, clip.channels, clip.codec) == (RATE, channels, "pcm_s16le")
    assert clip.samples.dtype == np.float32
    assert np.array_equal(clip.samples, (pcm.astype(np.float64).sum(axis=0) / channels / 32768).astype(np.float32))


@pytest.mark.parametrize(
    "name, codec, container, rate, channels",
    [
        ("a.wav", "pcm_s16le", None, 8000, 1),
        ("b.wav", "pcm_s16le", None, 22050, 2),
        ("c.wav", "pcm_s16le", None, 44100, 2),
        ("d.wav", "pcm_s16le", None, 48000, 1),
        ("e.flac", "flac", None, 48000, 2),
        ("f.flac", "flac", None, 44100, 1),
        # Matroska times packets in milliseconds: a short last packet's duration is rounded, so its length is decoded
        ("g.mka", "pcm_s16le", "matroska", 16000, 1),
        ("h.mka", "flac", "matroska", 44100, 2),
    ],
)
def test_lossless_clips_resample_to_their_content(tmp_path, h, name, codec, container, rate, channels):
    seconds = 1.37
    n = int(seconds * rate) + 3  # not a whole number of 16 kHz samples
    path = h.write_audio(tmp_path / name, _tones(n, rate, channels), rate, codec, container)
    clip = decode_audio(path, RATE)
    assert (clip.source_rate, clip.channels) == (rate, channels)
    assert abs(len(clip.samples) - n * RATE / rate) <= 1
    # the tokenization pass counts these codecs' packets after the first sound: the same length as the decode
    counted = decode_audio(path, RATE, waveform=False)
    assert counted.samples is None and counted.num_samples == clip.num_samples == len(clip.samples)
    expected = _expected(len(clip.samples), channels)
    edge = 64  # the resampler's filter sees beyond the clip at both ends
    assert np.abs(clip.samples[edge:-edge] - expected[edge:-edge]).max() < 1e-3


@pytest.mark.parametrize(
    "name, codec, container, rate, channels",
    [
        ("a.mp3", "libmp3lame", None, 44100, 2),
        ("b.mp3", "libmp3lame", None, 22050, 1),
        ("c.ogg", "libopus", "ogg", 48000, 1),
        ("d.opus", "libopus", "ogg", 24000, 2),
        ("e.m4a", "aac", "mp4", 22050, 2),
        ("f.m4a", "aac", "mp4", 48000, 1),
    ],
)
def test_lossy_clips_keep_their_content_aligned(tmp_path, h, name, codec, container, rate, channels):
    n = int(1.5 * rate)
    path = h.write_audio(tmp_path / name, _tones(n, rate, channels), rate, codec, container)
    clip = decode_audio(path, RATE)
    expected_len = n * RATE / rate
    # An encoder pads the last frame; FFmpeg trims that padding for MP3 and Opus but not for this MP4's AAC.
    assert expected_len - 1 <= len(clip.samples) <= expected_len + 2048 * RATE / rate
    span = slice(400, int(expected_len) - 400)
    assert _snr_db(clip.samples[span], _expected(len(clip.samples), channels)[span]) > 20


@pytest.mark.parametrize(
    "name, codec, container, rate, channels, max_diff",
    [
        ("a.wav", "pcm_s16le", None, 8000, 1, 0.0),
        ("b.wav", "pcm_s16le", None, 16000, 2, 0.0),
        ("c.wav", "pcm_s16le", None, 44100, 2, 0.0),
        ("d.flac", "flac", None, 48000, 2, 0.0),
        ("e.flac", "flac", None, 22050, 1, 0.0),
        ("f.mp3", "libmp3lame", None, 44100, 2, 1e-5),
        ("g.ogg", "libopus", "ogg", 48000, 1, 1e-5),
        ("h.opus", "libopus", "ogg", 24000, 2, 1e-2),
    ],
)
def test_load_audio_agrees(tmp_path, h, name, codec, container, rate, channels, max_diff):
    """transformers' `load_audio` with its soundfile backend (soundfile decodes, channels averaged, soxr resamples;
    soundfile in the dev group) gives the same number of samples, and for lossless clips the same samples bit for bit:
    `decode_audio` takes its steps. Lossy clips differ by their decoders (libsndfile's mpg123 and libopus against
    FFmpeg's): 1e-6 here for MP3 and 48 kHz Opus; an Opus stream made at 24 kHz is decoded at 24 kHz by libsndfile
    and at 48 kHz by FFmpeg, then resampled, so 4e-3. (Its torchcodec backend needs FFmpeg's shared libraries on the
    system, and downmixes stereo as 0.707 · (L + R).)"""
    from transformers.audio_utils import load_audio

    n = int(1.37 * rate) + 3
    path = h.write_audio(tmp_path / name, _tones(n, rate, channels), rate, codec, container)
    theirs, ours = load_audio(path, sampling_rate=RATE, backend="soundfile"), decode_audio(path, RATE).samples
    assert theirs.dtype == ours.dtype == np.float32 and len(theirs) == len(ours)
    if max_diff == 0.0:
        assert np.array_equal(theirs, ours)
    else:
        assert np.abs(theirs - ours).max() <= max_diff


def _row(audios, text="<audio>What is it?"):
    return {
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "A tone."}],
        "audios": audios,
    }


@pytest.fixture
def encoder(omni_processor, h, tmp_path):
    cfg = h.data_config(
        omni_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_omni_nothink"}, attr={"audios": "audios"}
    )
    return SampleEncoder(cfg, omni_processor)


@pytest.mark.timeout(60)
def test_zero_byte_not_audio_and_missing_files(encoder, tmp_path, h):
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "text.mp3").write_text("hello, this is not audio\n" * 20)
    (tmp_path / "noise.m4a").write_bytes(b"\x00\x00\x00\x18ftypM4A " + bytes(range(256)) * 8)
    for name in ("empty.wav", "text.mp3", "noise.m4a"):
        assert h.bad_reason(encoder, _row([name])) == "corrupt_audio", name
    assert h.bad_reason(encoder, _row(["absent.wav"])) == "missing_audio"
    h.write_video(tmp_path / "silent.mp4", 8, 48, 32)
    with pytest.raises(BadSample, match="has no audio stream") as bad:
        encoder.encode_row(_row(["silent.mp4"]))
    assert bad.value.reason == "unsupported_audio"


@pytest.mark.timeout(60)
def test_truncated_files(encoder, tmp_path, h):
    """A cut MP3 still announces its length in its Xing header and decodes to half of it; a cut FLAC breaks while
    decoding; a cut Ogg or MP4 cannot be opened. A cut WAV decodes to the samples it still holds (every byte of PCM is
    a sample; FFmpeg sizes it from the file), as any reader does: it is not bad."""
    tones = _tones(2 * 44100, 44100, 1)
    for name, codec, container in (("a.mp3", "libmp3lame", None), ("b.flac", "flac", None), ("c.ogg", "libopus", "ogg"),
                                   ("d.m4a", "aac", "mp4")):
        data = open(h.write_audio(tmp_path / f"whole_{name}", tones, 44100 if codec != "libopus" else 48000, codec,
                                  container), "rb").read()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        assert h.bad_reason(encoder, _row([name])) == "corrupt_audio", name
    with pytest.raises(BadSample, match="truncated"):
        encoder.encode_row(_row(["a.mp3"]))
    data = open(h.write_audio(tmp_path / "whole.wav", tones, 44100), "rb").read()
    header = len(data) - 2 * tones.shape[1]
    (tmp_path / "cut.wav").write_bytes(data[: header + 2 * 22050])  # the header and the first half second
    assert encoder.encode_row(_row(["cut.wav"]))["audio_grids"][0][0] == RATE // 2


@pytest.mark.timeout(60)
def test_too_long_and_too_short(omni_processor, h, tmp_path, monkeypatch):
    cfg = h.data_config(
        omni_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_omni_nothink", "audio_max_seconds": 1.5},
        attr={"audios": "audios"},
    )
    encoder = SampleEncoder(cfg, omni_processor)
    h.write_audio(tmp_path / "two.wav", _tones(2 * RATE, RATE, 1), RATE)
    h.write_audio(tmp_path / "one.wav", _tones(RATE, RATE, 1), RATE)
    assert encoder.encode_row(_row(["one.wav"]))["audio_grids"][0][0] == RATE
    with pytest.raises(BadSample, match="lasts 2.0 s, over audio_max_seconds 1.5") as bad:
        encoder.encode_row(_row(["two.wav"]))
    assert bad.value.reason == "audio_too_long"
    # a header without a duration: the decode stops as soon as it passes the limit
    monkeypatch.setattr(audio_module, "_header_seconds", lambda container, stream: None)
    with pytest.raises(BadSample, match=r"decodes to over [0-9.]+ s, over audio_max_seconds 1.5") as bad:
        encoder.encode_row(_row(["two.wav"]))
    assert bad.value.reason == "audio_too_long"
    monkeypatch.undo()
    h.write_audio(tmp_path / "blip.wav", _tones(399, RATE, 1), RATE)  # under one 400-sample STFT window
    with pytest.raises(BadSample, match="fewer than one feature window") as bad:
        encoder.encode_row(_row(["blip.wav"]))
    assert bad.value.reason == "empty_audio"
    with wave.open(str(tmp_path / "nothing.wav"), "wb") as empty:  # a valid header and no sample
        empty.setnchannels(1), empty.setsampwidth(2), empty.setframerate(RATE)
    with pytest.raises(BadSample, match="decodes to no samples") as bad:
        encoder.encode_row(_row(["nothing.wav"]))
    assert bad.value.reason == "empty_audio"


def test_a_large_tag_before_the_audio_is_skipped(tmp_path, h):
    """An MP3 behind a 200 kB ID3v2 tag (embedded cover art) decodes as without it: the container is opened with a
    16 KiB probe (`PROBE_BYTES`), and FFmpeg skips the tag before probing."""
    path = h.write_audio(tmp_path / "a.mp3", _tones(44100, 44100, 2), 44100, "libmp3lame")
    body = b"owner\x00" + bytes(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8))
    frame = b"PRIV" + len(body).to_bytes(4, "big") + b"\x00\x00" + body
    size = len(frame)
    syncsafe = bytes([(size >> 21) & 0x7F, (size >> 14) & 0x7F, (size >> 7) & 0x7F, size & 0x7F])
    (tmp_path / "tagged.mp3").write_bytes(b"ID3\x03\x00\x00" + syncsafe + frame + open(path, "rb").read())
    plain, tagged = decode_audio(path, RATE), decode_audio(str(tmp_path / "tagged.mp3"), RATE)
    assert (tagged.source_rate, tagged.channels) == (44100, 2) and np.array_equal(plain.samples, tagged.samples)


@pytest.mark.timeout(60)
def test_digital_silence_is_a_bad_row(encoder, tmp_path, h):
    """All-zero samples (a failed recording or export) are `silent_audio`, in any format; one non-zero sample, or
    quiet noise at -90 dB, is audio."""
    for name, codec, rate in (("zero.wav", "pcm_s16le", RATE), ("zero.flac", "flac", 44100)):
        h.write_audio(tmp_path / name, np.zeros((2, rate)), rate, codec)
        with pytest.raises(BadSample, match="digital silence") as bad:
            encoder.encode_row(_row([name]))
        assert bad.value.reason == "silent_audio"
    one = np.zeros((1, RATE))
    one[0, RATE // 2] = 1 / 32767
    h.write_audio(tmp_path / "one.wav", one, RATE)
    quiet = np.random.default_rng(0).uniform(-3e-5, 3e-5, (1, RATE))
    h.write_audio(tmp_path / "quiet.wav", quiet, RATE)
    for name in ("one.wav", "quiet.wav"):
        assert encoder.encode_row(_row([name]))["audio_grids"][0][0] == RATE


@pytest.mark.timeout(60)
def test_decoding_is_bounded_in_time(tmp_path, h):
    path = h.write_audio(tmp_path / "a.flac", _tones(3 * 44100, 44100, 2), 44100, "flac")
    assert len(decode_audio(path, RATE, timeout_s=30).samples) == 3 * RATE
    for timeout_s in (1e-9, 1e-4):  # fires in FFmpeg's open/read callback or in the per-packet check
        with pytest.raises(BadSample, match="took over") as bad:
            decode_audio(path, RATE, timeout_s=timeout_s)
        assert bad.value.reason == "audio_timeout"


@pytest.mark.timeout(60)
def test_paths_placeholders_and_families_without_audio(encoder, tmp_path, h, qwen_processor):
    h.write_audio(tmp_path / "a.wav", _tones(RATE, RATE, 1), RATE)
    assert h.bad_reason(encoder, _row(["../outside.wav"])) == "audio_outside_dataset_dir"
    assert h.bad_reason(encoder, _row(["a.wav", "a.wav"])) == "audio_count_mismatch"
    assert h.bad_reason(encoder, _row([], "What is <audio>?")) == "audio_count_mismatch"
    wrong = _row(["a.wav"], "Listen.")
    wrong["messages"][1]["content"] = "<audio>"
    assert h.bad_reason(encoder, wrong) == "audio_in_wrong_turn"
    cfg = h.data_config(
        qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}, attr={"audios": "audios"}
    )
    with pytest.raises(BadSample, match="image plugin 'qwen3_vl' .* reads no audio") as bad:
        SampleEncoder(cfg, qwen_processor).encode_row(_row(["a.wav"]))
    assert bad.value.reason == "audio_not_supported"


@pytest.mark.timeout(120)
def test_bad_audio_rows_are_counted_and_strict_names_file_row_and_reason(omni_processor, h, tmp_path):
    h.write_audio(tmp_path / "good.wav", _tones(RATE, RATE, 2), RATE)
    (tmp_path / "noise.wav").write_bytes(b"RIFF not a wave at all" * 32)
    rows = [_row(["good.wav"]), _row(["noise.wav"]), _row(["../x.wav"]), _row(["absent.wav"])]
    train = h.write_jsonl(tmp_path / "train.jsonl", rows)

    def config(**basic):
        return h.data_config(
            omni_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_omni_nothink"},
            attr={"audios": "audios"}, basic={"dataset": str(train), **basic},
        )

    dataset = build_dataset(config(), omni_processor)
    assert len(dataset) == 1 and dataset.media_kinds() == {"audio"}
    assert dataset.bad_row_counts == {"audio_outside_dataset_dir": 1, "missing_audio": 1, "corrupt_audio": 1}
    assert dataset[0]["input_features"].shape[0] == 1
    # a decode past audio_timeout in a worker: the item says so (the loader skips and counts it) instead of hanging
    plugin = dataset.encoder.plugin
    plugin.audio_options = dataclasses.replace(plugin.audio_options, timeout_s=1e-9)
    assert dataset[0]["bad_reason"] == "audio_timeout"
    # a clip that changed after the cache was built
    h.write_audio(tmp_path / "good.wav", _tones(RATE // 2, RATE, 2), RATE)
    plugin.audio_options = dataclasses.replace(plugin.audio_options, timeout_s=30)
    assert dataset[0]["bad_reason"] == "corrupt_audio" and "clear the cache" in dataset[0]["bad_detail"]
    with pytest.raises(DataError, match=r"train\.jsonl row 1: corrupt_audio: .*noise\.wav"):
        build_dataset(config(strict=True, cache_dir=str(tmp_path / "strict")), omni_processor)
