"""Video files: header metadata and bounded decoding of chosen frames, with PyAV (FFmpeg bundled in its wheels).

Two steps, at two times:

1. *Preprocessing* (`read_video_info`): the container and stream headers give the frame
   count, frame rate, duration, size and codec without decoding a frame. The image plugin
   samples frame indices from them (Qwen3-VL: HF's own `sample_frames`), so the token
   count of every video is known before any pixel is touched. A file that is missing, not
   a video, of a codec this FFmpeg cannot decode, or of an absurd size or duration is a
   `BadSample` here.
2. *DataLoader workers* (`decode_frames`): the stream is decoded from the start (no seeking,
   so the i-th frame is the i-th decoded frame, as HF's PyAV reader counts them) and only
   the sampled frames are converted to RGB; decoding stops after the last sampled frame.

Bounded in time: every packet and every frame checks a deadline (`timeout_s` per video,
counted from opening the file), so a stream that decodes slowly or never ends is abandoned
(`video_timeout`) after at most the deadline plus one packet's decode; `av.open` gets the
same bound as its open and per-read timeout (FFmpeg's interrupt callback, so a read that
blocks — a stalled network file system — is interrupted too). A file that yields fewer
frames than its header announced (truncated, corrupt) is `corrupt_video`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mmfsdp.data.av_files import first_stream, open_container
from mmfsdp.data.errors import BadSample

__all__ = [
    "MAX_VIDEO_DURATION_S",
    "MAX_VIDEO_FRAME_PIXELS",
    "VIDEO_TIMEOUT_S",
    "VideoInfo",
    "VideoOptions",
    "decode_frames",
    "read_video_info",
]

MAX_VIDEO_FRAME_PIXELS = 8192 * 8192
"""Largest frame (width × height) a video may have; larger is `unsupported_video` (one frame would take 200 MB)."""
MAX_VIDEO_DURATION_S = 24 * 3600.0
"""Longest video accepted, in seconds; longer is `unsupported_video` (decoding to a late frame would not end)."""
VIDEO_TIMEOUT_S = 60.0
"""Default bound on reading one video's header or decoding its sampled frames, in seconds."""


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's headers say: enough to sample frames and size its tokens."""

    num_frames: int
    """Frames in the stream (the header's count, else duration × frame rate rounded)."""
    fps: Fraction
    """Average frame rate of the stream."""
    duration: float
    """Seconds (`num_frames / fps`)."""
    width: int
    height: int
    codec: str


def read_video_info(path: str, *, timeout_s: float = VIDEO_TIMEOUT_S) -> VideoInfo:
    """The headers of the video at `path` (nothing is decoded); `BadSample` if it cannot or should not be used."""
    container = open_container(path, "video", timeout_s)
    try:
        stream = first_stream(container, path, "video")
        width, height = int(stream.width or 0), int(stream.height or 0)
        codec = stream.codec_context.name
        fps = Fraction(stream.average_rate) if stream.average_rate else None
        if not fps or fps <= 0:
            raise BadSample("corrupt_video", f"{path}: the video stream has no frame rate")
        duration = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
        if duration is None and container.duration:
            duration = container.duration / 1_000_000
        num_frames = int(stream.frames) if stream.frames else round((duration or 0.0) * fps)
    finally:
        container.close()
    if num_frames < 1:
        raise BadSample("corrupt_video", f"{path}: the video stream has no frames")
    if width < 1 or height < 1 or width * height > MAX_VIDEO_FRAME_PIXELS:
        raise BadSample(
            "unsupported_video",
            f"{path} is {width}x{height}; frames must have between 1 and {MAX_VIDEO_FRAME_PIXELS} pixels",
        )
    duration = float(num_frames / fps)
    if duration > MAX_VIDEO_DURATION_S:
        raise BadSample(
            "unsupported_video",
            f"{path} lasts {duration:.0f} s ({num_frames} frames at {float(fps):g} fps), "
            f"over {MAX_VIDEO_DURATION_S:.0f} s",
        )
    return VideoInfo(num_frames=num_frames, fps=fps, duration=duration, width=width, height=height, codec=codec)


def decode_frames(path: str, indices: list[int], *, timeout_s: float = VIDEO_TIMEOUT_S) -> np.ndarray:
    """Frames `indices` (increasing, 0-based in decode order) of the video at `path` as `[n, H, W, 3]` RGB uint8.

    Decodes from the start and stops after the last wanted frame; `BadSample` when the file ends
    (or breaks) first, or when `timeout_s` passes.
    """
    if not indices:
        raise ValueError("no frame indices to decode")
    deadline = time.monotonic() + timeout_s
    wanted = {index: k for k, index in enumerate(indices)}
    last = max(indices)
    frames: list[np.ndarray | None] = [None] * len(indices)
    seen = 0

    def overdue() -> None:
        if time.monotonic() > deadline:
            raise BadSample(
                "video_timeout",
                f"{path}: decoding {len(indices)} frames up to frame {last} took over {timeout_s:g} s "
                f"(at frame {seen})",
            )

    import av

    container = open_container(path, "video", timeout_s)
    try:
        stream = first_stream(container, path, "video")
        for packet in container.demux(stream):
            overdue()
            for frame in packet.decode():
                overdue()
                if seen in wanted:
                    frames[wanted[seen]] = frame.to_ndarray(format="rgb24")
                seen += 1
                if seen > last:
                    break
            if seen > last:
                break
    except BadSample:
        raise
    except av.error.ExitError:
        raise BadSample("video_timeout", f"{path}: a read took over {timeout_s:g} s (at frame {seen})") from None
    except Exception as err:  # a decoder error mid-stream: the file is damaged
        raise BadSample("corrupt_video", f"{path} breaks at frame {seen} ({type(err).__name__}: {err})") from None
    finally:
        container.close()
    if seen <= last:
        what = "no decodable frames" if seen == 0 else f"only {seen} decodable frames"
        raise BadSample(
            "corrupt_video",
            f"{path} has {what}, but frame {last} was sampled from its header (truncated or damaged file)",
        )
    shapes = {f.shape for f in frames if f is not None}
    if len(shapes) != 1:
        raise BadSample("corrupt_video", f"{path}: the frame size changes within the stream ({sorted(shapes)})")
    return np.stack(frames)


@dataclass(frozen=True, slots=True)
class VideoOptions:
    """The video settings of `preprocess_parameters` that a plugin samples and sizes videos with."""

    fps: float | None = None
    """`video_fps`: frames sampled per second of video; None = the video processor's own `fps`."""
    maxlen: int | None = None
    """`video_maxlen`: most frames sampled from one video; None = the video processor's own `max_frames`."""
    max_pixels: int | None = None
    """`video_max_pixels`: per-frame downscale limit before the video processor."""
    min_pixels: int | None = None
    """`video_min_pixels`: per-frame upscale limit before the video processor."""
    total_pixels: int | None = None
    """`video_total_pixels`: one sample's budget over all its sampled frames."""
    timeout_s: float = VIDEO_TIMEOUT_S
    """`video_timeout`: bound on opening / decoding one video."""

    @classmethod
    def from_config(cls, pp) -> VideoOptions:
        """From a `PreprocessParametersConfig`."""
        return cls(
            fps=pp.video_fps,
            maxlen=pp.video_maxlen,
            max_pixels=pp.video_max_pixels,
            min_pixels=pp.video_min_pixels,
            total_pixels=pp.video_total_pixels,
            timeout_s=pp.video_timeout,
        )

    def frame_max_pixels(self, num_frames_in_sample: int) -> int | None:
        """Per-frame pixel limit of a sample with this many sampled frames: `max_pixels`, lowered to its share of
        `total_pixels` (never under `min_pixels`)."""
        limit = self.max_pixels
        if self.total_pixels is not None and num_frames_in_sample > 0:
            share = max(self.total_pixels // num_frames_in_sample, self.min_pixels or 1)
            limit = share if limit is None else min(limit, share)
        return limit
