"""Audio files: decoded, downmixed and resampled to the waveform a feature extractor takes.

`decode_audio(path, sampling_rate, ...)` reads any container and codec PyAV's bundled FFmpeg decodes (WAV, FLAC,
MP3, Ogg Vorbis / Opus, M4A / AAC, ...) at any sample rate and channel count, and returns a mono float32 waveform
at `sampling_rate` (the model's feature extractor's rate, read from the model directory), by the steps of
transformers' own `load_audio` (its soundfile backend, which is `librosa.load`'s):

1. PyAV decodes the clip; every frame's samples become float32 in [-1, 1) as soundfile reads them (integer PCM
   divided by 2^(bits-1));
2. the channels are averaged (mono = their mean), as `librosa.load`, transformers' soundfile and torchaudio backends
   and LLaMA-Factory's loader downmix;
3. a clip at another rate is resampled once, whole, with soxr's high-quality filter (`soxr_hq`) to
   `ceil(samples · sampling_rate / source rate)` samples (padded with zeros or cut to that length).
So a WAV or FLAC clip gives exactly what `load_audio(path, sampling_rate)` gives; formats soundfile does not read
(MP3 in older libsndfile, AAC, Opus) go through the same steps after FFmpeg's decoder.

Unlike a video, whose frames are sampled from its headers, an audio clip's token count needs its exact length after
resampling, which no header gives for every format: the tokenization pass (`waveform=False`) reads each clip once
for its length, and the DataLoader workers decode it again for its features (a clip of a minute decodes in a few
milliseconds). The tokenization pass converts samples only until it has heard a sound (the silence check); after
that, a PCM or FLAC clip's remaining packets are counted from their durations (exactly their samples for these
codecs) without decoding, while other codecs (MP3, AAC, Opus, Vorbis: encoder delay and padding make the decoded
length differ from the packets') are decoded to the end.
The container is opened with a bounded probe (`PROBE_BYTES`): FFmpeg's default reads up to 5 MB to find the
streams, the whole of most clips, where an audio file's headers are at its start; a WAV file is read in packets of
up to `PACKET_BYTES`.

Bounded: the open and every read get `timeout_s` as PyAV's timeout (FFmpeg's interrupt callback) and the decode loop
checks the same deadline at every packet and frame (`audio_timeout`); a clip longer than `max_seconds` is refused from
its header when the header gives a duration, else as soon as that much has been decoded (`audio_too_long`), so a
file of hours never fills memory. A file that is missing (`missing_audio`), not a readable container or stream, or
breaks while decoding, or decodes to under 90 % of the duration its header gives (truncated) is `corrupt_audio`; one
without an audio stream or of a codec FFmpeg cannot decode is `unsupported_audio`; one that decodes to no sample at
all is `empty_audio`, one whose samples are all zero (digital silence: nothing to hear, most often a failed
recording or export) `silent_audio`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mmfsdp.data.av_files import first_stream, open_container
from mmfsdp.data.errors import BadSample

__all__ = [
    "AUDIO_MAX_SECONDS", "AUDIO_TIMEOUT_S", "AudioOptions", "DecodedAudio", "PACKET_BYTES", "PROBE_BYTES", "RESAMPLER",
    "TRUNCATED_SHARE", "decode_audio", "has_audio_stream",
]

AUDIO_MAX_SECONDS = 300.0
"""Default longest clip, in seconds (`audio_max_seconds`): Qwen3-Omni's published feature-extractor window
(`n_samples` 4 800 000 at 16 kHz), where LLaMA-Factory cuts its clips."""
AUDIO_TIMEOUT_S = 60.0
"""Default bound on opening and decoding one clip, in seconds (`audio_timeout`)."""
TRUNCATED_SHARE = 0.9
"""A clip that decodes to less than this share of the duration its header gives is truncated (`corrupt_audio`).
Not tighter: a header's duration is an estimate for some formats (an MP3 without a Xing header)."""


PROBE_BYTES = 16384
"""FFmpeg's `probesize` when opening a clip: bytes read to find its streams (FFmpeg's default, 5 MB, is most clips)."""
PACKET_BYTES = 262144
"""The WAV demuxer's packet size bound (its `max_size`; FFmpeg's default 4096 bytes makes a 10 s stereo clip 108
packets, each a round trip through PyAV); other demuxers have their own packets and ignore it."""
RESAMPLER = "soxr_hq"
"""The resampling filter (soxr's quality name), as transformers' `load_audio` and `librosa.load` resample."""
_INT_SCALE = {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9223372036854775808.0}
"""Integer sample formats -> the divisor that maps them to [-1, 1) (unsigned 8-bit is offset by 128 first)."""


@dataclass(frozen=True, slots=True)
class AudioOptions:
    """The audio settings of `preprocess_parameters` that a plugin decodes clips with."""

    max_seconds: float = AUDIO_MAX_SECONDS
    """`audio_max_seconds`: longest clip accepted; longer is the bad row `audio_too_long` (never cut)."""
    timeout_s: float = AUDIO_TIMEOUT_S
    """`audio_timeout`: bound on opening / decoding one clip."""
    in_video: bool = False
    """`use_audio_in_video`: a video's own audio track is read as a clip of its sample (a plugin that interleaves
    it with the video's tokens)."""

    @classmethod
    def from_config(cls, pp) -> AudioOptions:
        """From a `PreprocessParametersConfig`."""
        return cls(max_seconds=pp.audio_max_seconds, timeout_s=pp.audio_timeout, in_video=pp.use_audio_in_video)


def has_audio_stream(path: str, timeout_s: float = AUDIO_TIMEOUT_S) -> bool:
    """Whether the (video) file at `path` holds an audio stream, from its headers; `BadSample` if it cannot be
    opened."""
    container = open_container(path, "video", timeout_s, options={"probesize": PROBE_BYTES})
    try:
        return bool(container.streams.audio)
    finally:
        container.close()


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    """One clip as the feature extractor takes it, and what its file held."""

    samples: np.ndarray | None
    """Mono float32 waveform at the requested sampling rate, `[num_samples]`; None when only the length was asked
    for (`decode_audio(..., waveform=False)`)."""
    num_samples: int
    """Samples of the waveform at the requested rate: `ceil(source samples · rate / source rate)`."""
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
    """The stream's duration from the headers (None when they give none): its own, else the container's where the
    stream is all it holds (a video's container lasts as long as its longest stream, not its audio track)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    alone = len(container.streams) == 1
    return container.duration / 1_000_000 if container.duration and alone else None


def decode_audio(
    path: str, sampling_rate: int, *, max_seconds: float = AUDIO_MAX_SECONDS, timeout_s: float = AUDIO_TIMEOUT_S,
    waveform: bool = True,
) -> DecodedAudio:
    """The clip at `path` as a mono float32 waveform at `sampling_rate` (module docstring); `BadSample` if it cannot
    or should not be used. With `waveform=False` the clip is decoded and checked alike but not resampled: its
    `num_samples` (what a token count needs) without its samples."""
    import av

    deadline = time.monotonic() + timeout_s
    frames: list[np.ndarray] = []
    formats: list[tuple[str, bool, int]] = []  # each frame's (sample format, planar, channels)
    total, source_rate = 0, sampling_rate  # source samples decoded so far; the file's rate once its stream is read
    heard = False  # a frame with a non-zero sample decoded

    def overdue() -> None:
        if time.monotonic() > deadline:
            raise BadSample(
                "audio_timeout", f"{path}: decoding took over {timeout_s:g} s (at {total / source_rate:.1f} s)"
            )

    def too_long(seconds: float, how: str) -> BadSample:
        return BadSample(
            "audio_too_long",
            f"{path} {how} {seconds:.1f} s, over audio_max_seconds {max_seconds:g} (clips are never cut)",
        )

    # large WAV packets for a decode (fewer calls), FFmpeg's small ones for a count (its open reads one packet less)
    options = {"probesize": PROBE_BYTES, **({"max_size": PACKET_BYTES} if waveform else {})}
    container = open_container(path, "audio", timeout_s, options=options)
    try:
        stream = _audio_stream(container, path)
        source_rate, channels, codec = int(stream.rate), int(stream.channels), stream.codec_context.name
        header = _header_seconds(container, stream)
        if header is not None and header > max_seconds:
            raise too_long(header, "lasts")
        max_source = int(max_seconds * source_rate)
        # the length pass of a codec whose packets are its samples: once a sound is heard, packets are counted from
        # their durations instead of decoded (a damaged packet is then found by the load's decode, counted there) —
        # where the container times them to the sample (WAV, FLAC: 1 / rate), not in milliseconds (Matroska), whose
        # rounded durations miscount a short last packet
        fine = stream.time_base is not None and stream.time_base <= Fraction(1, source_rate)
        counted = not waveform and (codec.startswith("pcm_") or codec == "flac") and fine
        for packet in container.demux(stream):
            overdue()
            if counted and heard and packet.size and packet.duration:
                samples = packet.duration * stream.time_base * source_rate
                if samples.denominator == 1:
                    total += int(samples)
                    if total > max_source:
                        raise too_long(total / source_rate, "decodes to over")
                    continue
            for frame in packet.decode():
                overdue()
                if waveform or not heard:  # the length pass reads samples only until it has heard a sound
                    data, name = frame.to_ndarray(), frame.format.name
                    heard = heard or not _silent(data, name)
                    if waveform:
                        formats.append((name, frame.format.is_planar, len(frame.layout.channels)))
                        frames.append(data)
                total += frame.samples
                if total > max_source:
                    raise too_long(total / source_rate, "decodes to over")
    except BadSample:
        raise
    except av.error.ExitError:
        raise BadSample("audio_timeout", f"{path}: a read took over {timeout_s:g} s") from None
    except Exception as err:  # a decoder error mid-stream: the file is damaged
        detail = f"{path} breaks after {total / source_rate:.2f} s ({type(err).__name__}: {err})"
        raise BadSample("corrupt_audio", detail) from None
    finally:
        container.close()
    if total == 0:
        raise BadSample("empty_audio", f"{path} decodes to no samples")
    if header is not None and total < TRUNCATED_SHARE * header * source_rate:
        raise BadSample(
            "corrupt_audio",
            f"{path} decodes to {total / source_rate:.2f} s, but its header gives {header:.2f} s "
            "(truncated or damaged file)",
        )
    if not heard:
        raise BadSample("silent_audio", f"{path} is digital silence: its {total} samples are all zero")
    num_samples = math.ceil(total * sampling_rate / source_rate)
    if not waveform:
        return DecodedAudio(None, num_samples, source_rate, channels, codec)
    if len(set(formats)) == 1:  # one conversion for the whole clip
        mono = _mono(_float_samples(np.concatenate(frames, axis=1), *formats[0]))
    else:  # a stream whose frames change format or channel layout: each frame converted and downmixed alone
        mono = np.concatenate([_mono(_float_samples(frame, *fmt)) for frame, fmt in zip(frames, formats)])
    return DecodedAudio(resample(mono, source_rate, sampling_rate), num_samples, source_rate, channels, codec)


def resample(waveform: np.ndarray, source_rate: int, sampling_rate: int) -> np.ndarray:
    """A mono float32 waveform at `sampling_rate`: soxr (`RESAMPLER`) on the whole clip, padded with zeros or cut to
    `ceil(len · sampling_rate / source_rate)` samples, as transformers' `load_audio` and `librosa.load` do."""
    if source_rate != sampling_rate:
        import soxr

        length = math.ceil(len(waveform) * sampling_rate / source_rate)
        waveform = soxr.resample(waveform, source_rate, sampling_rate, quality=RESAMPLER)
        waveform = np.pad(waveform, (0, max(0, length - len(waveform))))[:length]
    return np.ascontiguousarray(waveform, dtype=np.float32)


def _float_samples(data: np.ndarray, name: str, planar: bool, channels: int) -> np.ndarray:
    """Decoded samples (`AudioFrame.to_ndarray()`s of one format, concatenated along their last axis) as float32
    `[channels, samples]` in [-1, 1): float formats as they are, integer ones divided by 2^(bits-1) (soundfile's
    float reading; unsigned 8-bit offset by 128 first)."""
    # channel-major in memory: the downmix then adds contiguous rows (4x faster than over a transposed view)
    data = data.reshape(channels, -1) if planar else np.ascontiguousarray(data.reshape(-1, channels).T)
    kind = name.rstrip("p")
    if kind in _INT_SCALE:
        data = data.astype(np.float32)
        if kind == "u8":
            data -= np.float32(128)
        data /= np.float32(_INT_SCALE[kind])
        return data
    return data.astype(np.float32, copy=False)


def _silent(data: np.ndarray, name: str) -> bool:
    """Whether a frame's samples (as decoded, format `name`) are all zero: 128 for unsigned 8-bit."""
    return bool((data == 128).all()) if name.rstrip("p") == "u8" else not data.any()


def _mono(planes: np.ndarray) -> np.ndarray:
    """`[channels, samples]` -> their mean `[samples]` (float32)."""
    return planes.mean(axis=0) if planes.shape[0] > 1 else planes[0]
