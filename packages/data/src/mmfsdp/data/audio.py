"""Audio files: decoded, resampled and downmixed to the waveform a feature extractor takes, with PyAV.

`decode_audio(path, sampling_rate, ...)` reads any container and codec PyAV's bundled FFmpeg decodes (WAV, FLAC,
MP3, Ogg Vorbis / Opus, M4A / AAC, ...) at any sample rate and channel count, and returns a mono float32 waveform
at `sampling_rate` (the model's feature extractor's rate, read from the model directory):

1. every decoded frame goes through one `av.AudioResampler` (FFmpeg's libswresample, its default filter) that
   converts it to planar float at `sampling_rate`, keeping its channels;
2. the channels are averaged (mono = their mean), as `librosa.load`, transformers' soundfile and torchaudio backends
   and LLaMA-Factory's loader downmix. (libswresample's own stereo-to-mono matrix is 0.707 · (L + R), 3 dB louder
   than the mean, so the downmix is not left to it.)

Unlike a video, whose frames are sampled from its headers, an audio clip's token count needs its exact length after
resampling, which no header gives for every format: the tokenization pass decodes each clip once for its length,
and the DataLoader workers decode it again for its features (a clip of a minute decodes in tens of milliseconds).

Bounded: the open and every read get `timeout_s` as PyAV's timeout (FFmpeg's interrupt callback) and the decode loop
checks the same deadline at every packet and frame (`audio_timeout`); a clip longer than `max_seconds` is refused from
its header when the header gives a duration, else as soon as that much has been decoded (`audio_too_long`), so a
file of hours never fills memory. A file that is missing (`missing_audio`), not a readable container or stream, or
breaks while decoding, or decodes to under 90 % of the duration its header gives (truncated) is `corrupt_audio`; one
without an audio stream or of a codec FFmpeg cannot decode is `unsupported_audio`; one that decodes to no sample at
all is `empty_audio`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from mmfsdp.data.av_files import first_stream, open_container
from mmfsdp.data.errors import BadSample

__all__ = [
    "AUDIO_MAX_SECONDS", "AUDIO_TIMEOUT_S", "AudioOptions", "DecodedAudio", "TRUNCATED_SHARE", "decode_audio",
]

AUDIO_MAX_SECONDS = 300.0
"""Default longest clip, in seconds (`audio_max_seconds`): Qwen3-Omni's published feature-extractor window
(`n_samples` 4 800 000 at 16 kHz), where LLaMA-Factory cuts its clips."""
AUDIO_TIMEOUT_S = 60.0
"""Default bound on opening and decoding one clip, in seconds (`audio_timeout`)."""
TRUNCATED_SHARE = 0.9
"""A clip that decodes to less than this share of the duration its header gives is truncated (`corrupt_audio`).
Not tighter: a header's duration is an estimate for some formats (an MP3 without a Xing header)."""


@dataclass(frozen=True, slots=True)
class AudioOptions:
    """The audio settings of `preprocess_parameters` that a plugin decodes clips with."""

    max_seconds: float = AUDIO_MAX_SECONDS
    """`audio_max_seconds`: longest clip accepted; longer is the bad row `audio_too_long` (never cut)."""
    timeout_s: float = AUDIO_TIMEOUT_S
    """`audio_timeout`: bound on opening / decoding one clip."""

    @classmethod
    def from_config(cls, pp) -> AudioOptions:
        """From a `PreprocessParametersConfig`."""
        return cls(max_seconds=pp.audio_max_seconds, timeout_s=pp.audio_timeout)


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    """One clip as the feature extractor takes it, and what its file held."""

    samples: np.ndarray
    """Mono float32 waveform at the requested sampling rate, `[num_samples]`."""
    source_rate: int
    """Sample rate of the file's audio stream."""
    channels: int
    """Channels of the file's audio stream (averaged into `samples`)."""
    codec: str
    """FFmpeg's name of the stream's codec."""


def _audio_stream(container, path: str):
    stream = first_stream(container, path, "audio")
    if not stream.rate or stream.rate < 1:
        raise BadSample("corrupt_audio", f"{path}: the audio stream has no sample rate")
    return stream


def _header_seconds(container, stream) -> float | None:
    """The stream's duration from the headers (None when they give none)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else None


def decode_audio(
    path: str, sampling_rate: int, *, max_seconds: float = AUDIO_MAX_SECONDS, timeout_s: float = AUDIO_TIMEOUT_S
) -> DecodedAudio:
    """The clip at `path` as a mono float32 waveform at `sampling_rate` (module docstring); `BadSample` if it cannot
    or should not be used."""
    import av

    deadline = time.monotonic() + timeout_s
    max_samples = int(max_seconds * sampling_rate)
    planes: list[np.ndarray] = []
    total = 0

    def overdue() -> None:
        if time.monotonic() > deadline:
            raise BadSample(
                "audio_timeout", f"{path}: decoding took over {timeout_s:g} s (at {total / sampling_rate:.1f} s)"
            )

    def too_long(seconds: float, how: str) -> BadSample:
        return BadSample(
            "audio_too_long",
            f"{path} {how} {seconds:.1f} s, over audio_max_seconds {max_seconds:g} (clips are never cut)",
        )

    container = open_container(path, "audio", timeout_s)
    try:
        stream = _audio_stream(container, path)
        source_rate, channels, codec = int(stream.rate), int(stream.channels), stream.codec_context.name
        header = _header_seconds(container, stream)
        if header is not None and header > max_seconds:
            raise too_long(header, "lasts")
        resampler = None
        for packet in container.demux(stream):
            overdue()
            for frame in packet.decode():
                overdue()
                if resampler is None:
                    resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=sampling_rate)
                for out in resampler.resample(frame):
                    planes.append(out.to_ndarray())
                    total += out.samples
                if total > max_samples:
                    raise too_long(total / sampling_rate, "decodes to over")
        for out in resampler.resample(None) if resampler is not None else ():
            planes.append(out.to_ndarray())
            total += out.samples
    except BadSample:
        raise
    except av.error.ExitError:
        raise BadSample("audio_timeout", f"{path}: a read took over {timeout_s:g} s") from None
    except Exception as err:  # a decoder error mid-stream: the file is damaged
        detail = f"{path} breaks after {total / sampling_rate:.2f} s ({type(err).__name__}: {err})"
        raise BadSample("corrupt_audio", detail) from None
    finally:
        container.close()
    if total == 0:
        raise BadSample("empty_audio", f"{path} decodes to no samples")
    if total > max_samples:
        raise too_long(total / sampling_rate, "decodes to")
    if header is not None and total < TRUNCATED_SHARE * header * sampling_rate:
        raise BadSample(
            "corrupt_audio",
            f"{path} decodes to {total / sampling_rate:.2f} s, but its header gives {header:.2f} s "
            "(truncated or damaged file)",
        )
    samples = np.concatenate(planes, axis=1).mean(axis=0, dtype=np.float32)
    return DecodedAudio(samples=samples, source_rate=source_rate, channels=channels, codec=codec)
