"""Opening a media file with PyAV, bounded in time: the one way videos (`mmfsdp.data.video`) and audio clips
(`mmfsdp.data.audio`) are opened, and each reads its first stream of its kind.

`open_container` gives FFmpeg `timeout_s` as its open and per-read timeout (an interrupt callback, so a read that
blocks on a stalled network file system is cut too); each failure is a `BadSample` under the kind's own reason:
`missing_<kind>` (no such file), `<kind>_timeout`, `corrupt_<kind>` (no readable container: zero bytes, not a media
file, cut before its headers end). `first_stream` refuses a file without a stream of the kind, or whose codec PyAV's
bundled FFmpeg cannot decode (`unsupported_<kind>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmfsdp.data.errors import BadSample

__all__ = ["first_stream", "open_container"]


def open_container(path: str, kind: str, timeout_s: float, *, options: dict[str, int] | None = None) -> Any:
    """The PyAV input container of the `kind` ("video", "audio") file at `path`; `BadSample` if it cannot be opened.
    `options`: FFmpeg's format options (e.g. `probesize`, the bytes it reads to find the streams); a demuxer ignores
    the ones it does not have."""
    import av

    if not Path(path).is_file():
        raise BadSample(f"missing_{kind}", f"{path} does not exist")
    try:
        settings = {name: str(value) for name, value in (options or {}).items()}
        return av.open(path, mode="r", timeout=(timeout_s, timeout_s), options=settings)
    except av.error.ExitError:  # FFmpeg's interrupt callback: the open/read timeout fired
        raise BadSample(f"{kind}_timeout", f"{path}: opening it took over {timeout_s:g} s") from None
    except Exception as err:  # PyAV raises FFmpeg's many error types (InvalidDataError, EOFError, ...)
        detail = f"{path} is not a readable {kind} file ({type(err).__name__}: {err})"
        raise BadSample(f"corrupt_{kind}", detail) from None


def first_stream(container: Any, path: str, kind: str) -> Any:
    """The first `kind` stream of `container`; `BadSample` if there is none or its codec cannot be decoded."""
    import av

    streams = getattr(container.streams, kind)
    if not streams:
        raise BadSample(f"unsupported_{kind}", f"{path} has no {kind} stream")
    stream = streams[0]
    name = stream.codec_context.name if stream.codec_context is not None else None
    try:
        av.Codec(name, "r")
    except Exception:
        detail = f"{path}: its codec {name!r} cannot be decoded by PyAV's bundled FFmpeg"
        raise BadSample(f"unsupported_{kind}", detail) from None
    return stream
