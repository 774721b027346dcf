"""Image plugins: how a model family turns an image into tokens and pixels, registry keyed by name.

Every plugin implements `ImagePlugin`. The dataset sees only that protocol:

- `read_grid(path)` (preprocessing, header only) -> the image's *grid*: a tuple of
  ints that fixes its token count, opaque to everything but the plugin; it is stored
  in the tokenized cache and handed back to `image_tokens` and `pixel_inputs`.
- `image_tokens(grid)` -> the token ids that stand for the image in the text.
- `pixel_inputs(paths, grids)` (DataLoader workers) -> this sample's image tensors,
  keyed as the model and the family's collator expect them.
- `token_inputs(input_ids)` -> per-token inputs besides the ids (Qwen's
  `mm_token_type_ids`; none for Pixtral).
- `fingerprint()` -> every setting that changes tokens, for the cache key.
- `media_settings()` -> the effective image and video settings, each with where its value came from (the config,
  a file of the model directory as transformers' `from_pretrained` read it, or transformers' default), for
  `mm-data inspect` and `--check`.
- `image_token_ids` -> the ids that belong to image, video and audio blocks (never trained, never cut).
- optional `write_tiny_processor(out_dir, *, image_size, patch_size, spatial_merge_size)` (a static method):
  writes a tiny offline processor for the synthetic data (`synthetic_shapes`) when its directory is missing.
- `supports_video` -> whether it also implements `VideoPlugin`: `read_video_grids(paths)`
  (preprocessing, headers only: samples the frames), `video_tokens(grid)`,
  `video_inputs(paths, grids)` (workers: decodes only the sampled frames, bounded in
  time by `video_timeout`, see `mmfsdp.data.video`). A video row for a plugin without it
  is a bad row (`video_not_supported`).
- `supports_audio` -> whether it also implements `AudioPlugin`: `read_audio_grids(paths)` (preprocessing: decodes
  each clip once for its exact length, `mmfsdp.data.audio`), `audio_tokens(grid)`, `audio_inputs(paths, grids)`
  (workers: decodes again and runs the feature extractor). Such a plugin's constructor takes `audio=AudioOptions`.
  An audio row for a plugin without it is a bad row (`audio_not_supported`).
- optional `read_media_grids(video_paths, audio_paths)` -> (video grids, audio grids) read together, for a plugin
  whose clips' tokens depend on its videos' audio tracks (Qwen3-Omni's `use_audio_in_video`), and optional
  `arrange_media(input_ids, media)` -> the sample's media lists in the order their tokens came out (its tracks
  among its clips).

Pixels (and audio features) are made only in `pixel_inputs` / `video_inputs` / `audio_inputs`, i.e. in DataLoader
workers. Each family's plugin
lives in its folder (`mmfsdp.data.families.<name>.plugin`) and registers when the registry is first asked
(entry-point group `mmfsdp.data_families`); the helpers here (header sizes, decoding, the optional pixel-limit
pre-resize) are shared.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from PIL import Image

from mmfsdp.config import Registry

from mmfsdp.data.errors import BadSample
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.video import VideoOptions

__all__ = [
    "AudioPlugin",
    "ImagePlugin",
    "MediaSetting",
    "VideoPlugin",
    "decode_image",
    "get_plugin",
    "header_size",
    "plugin_names",
    "processor_file",
    "read_json",
    "register_plugin",
    "scale_to_pixel_limits",
    "setting_source",
    "size_value",
]

_KEY = "data.dataset_param.preprocess_parameters"


@runtime_checkable
class ImagePlugin(Protocol):
    """What the dataset needs from a model family's image handling (see the module docstring)."""

    name: ClassVar[str]
    """The name users write in `preprocess_parameters.image_plugin`. An optional class attribute `aliases` (tuple) lists other names that select it
    (older or alternative spellings users' YAML has)."""
    image_token_ids: frozenset[int]
    """Ids that belong to image, video and audio blocks (never trained, never cut)."""
    supports_video: ClassVar[bool]
    """Whether the plugin also implements `VideoPlugin`; a video row of a plugin without it is `video_not_supported`."""
    supports_audio: ClassVar[bool]
    """Whether the plugin also implements `AudioPlugin`; an audio row of a plugin without it is
    `audio_not_supported`."""

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """The HF multimodal processor around `tokenizer` (it holds the image processor), from the model directory."""
        ...

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None,
    ): ...

    def read_grid(self, path: str) -> tuple[int, ...]:
        """The grid of the image file at `path`, from its header; `BadSample` if missing, unreadable or unusable."""
        ...

    def image_tokens(self, grid: tuple[int, ...]) -> list[int]:
        """The token ids of an image with this grid."""
        ...

    def pixel_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """Decode and process one sample's images (tokenized with `grids`); `BadSample` on failure."""
        ...

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token model inputs of one sample besides its ids (same length as `input_ids`), e.g. modality types."""
        ...

    def fingerprint(self) -> list[Any]:
        """JSON-able settings that change tokens (the image processor's own config is hashed separately)."""
        ...

    def media_settings(self) -> list[MediaSetting]:
        """The effective image (and video) settings and where each value came from."""
        ...

    def describe(self, grid: tuple[int, ...]) -> str:
        """One line about an image's tokens, for `mm-data inspect`."""
        ...

    def label(self, grid: tuple[int, ...]) -> str:
        """How an image block is shown in decoded text (`<image LABEL>`)."""
        ...


@runtime_checkable
class VideoPlugin(Protocol):
    """The video half of a plugin with `supports_video` (see the module docstring).

    A video's *grid* is, like an image's, a tuple of ints fixed at preprocessing and stored in
    the cache; it holds whatever the plugin needs to decode and check the video later (for
    Qwen: the patch grid, the frame size before the video processor, the frame rate and the
    sampled frame indices)."""

    def read_video_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        """The grids of one sample's videos from their headers (frames are sampled here); `BadSample` on failure."""
        ...

    def video_tokens(self, grid: tuple[int, ...]) -> list[int]:
        """The token ids of a video with this grid."""
        ...

    def video_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """Decode the sampled frames of one sample's videos and process them; `BadSample` on failure."""
        ...

    def describe_video(self, grid: tuple[int, ...]) -> str:
        """One line about a video's sampled frames and tokens, for `mm-data inspect`."""
        ...

    def video_label(self, grid: tuple[int, ...]) -> str:
        """How a video block is shown in decoded text (`<video LABEL>`)."""
        ...


@runtime_checkable
class AudioPlugin(Protocol):
    """The audio half of a plugin with `supports_audio` (see the module docstring).

    An audio clip's *grid* is a tuple of ints fixed at preprocessing and stored in the cache: what the plugin needs to
    size its tokens and to check the clip decodes the same later (for Qwen3-Omni: the samples after resampling, the
    feature frames, the tokens, the file's sample rate and channels)."""

    def read_audio_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        """The grids of one sample's clips (each decoded once for its length); `BadSample` on failure."""
        ...

    def audio_tokens(self, grid: tuple[int, ...]) -> list[int]:
        """The token ids of a clip with this grid."""
        ...

    def audio_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """Decode one sample's clips and run the feature extractor on them; `BadSample` on failure."""
        ...

    def audio_seconds(self, grid: tuple[int, ...]) -> float:
        """Seconds of sound of a clip with this grid (after decoding), for `mm-data stats`."""
        ...

    def describe_audio(self, grid: tuple[int, ...]) -> str:
        """One line about a clip's decoding and tokens, for `mm-data inspect`."""
        ...

    def audio_label(self, grid: tuple[int, ...]) -> str:
        """How an audio block is shown in decoded text (`<audio LABEL>`)."""
        ...


@dataclass(frozen=True, slots=True)
class MediaSetting:
    """One effective image or video setting, as a plugin applies it, and where its value came from."""

    key: str
    """The `preprocess_parameters` key, or `video_processor.NAME` / `image_processor.NAME` for a processor setting
    that no key shadows."""
    value: Any
    source: str
    """`config`, `model directory: FILE` (the file transformers read the processor from) or `transformers default
    (CLASS.NAME)`; for a null key that has no processor value, what null means."""

    def __str__(self) -> str:
        return f"{self.key:<36} {self.value} ({self.source})"


def processor_file(model_dir: Path, section: str, files: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The file transformers' `from_pretrained` takes a processor's settings from, and those settings:
    `processor_config.json`'s `section` (`image_processor`, `video_processor`), else the first of `files`."""
    nested = read_json(model_dir / "processor_config.json").get(section)
    if isinstance(nested, dict):
        return f"processor_config.json ({section})", nested
    for name in files:
        if (model_dir / name).is_file():
            return name, read_json(model_dir / name)
    return None


def setting_source(
    found: tuple[str, dict[str, Any]] | None, keys: tuple[str, ...], processor: Any, name: str
) -> str:
    """Where a loaded processor's setting `name` came from: the model directory's file when it has any of `keys`
    (`found` is `processor_file`'s answer), else transformers' default for the processor class."""
    if found is not None and any(key in found[1] for key in keys):
        return f"model directory: {found[0]}"
    return f"transformers default ({type(processor).__name__}.{name})"


_PLUGINS: Registry[type[ImagePlugin]] = Registry("image plugin", f"{_KEY}.image_plugin", entry_point_group="mmfsdp.data_families")


def register_plugin(cls: type) -> type:
    return _PLUGINS.register(cls.name, cls, aliases=getattr(cls, "aliases", ()))


def plugin_names() -> list[str]:
    return _PLUGINS.names()


def get_plugin(name: str) -> type[ImagePlugin]:
    return _PLUGINS.get(name)


def header_size(path: str) -> tuple[int, int]:
    """(width, height) of the image file at `path` from its header only; `BadSample` if missing/unreadable."""
    if not Path(path).is_file():
        raise BadSample("missing_image", f"{path} does not exist")
    try:
        with Image.open(path) as image:
            return image.size
    except Exception as err:  # PIL raises many types for unreadable files
        raise BadSample("corrupt_image", f"{path} is not a readable image ({type(err).__name__}: {err})") from None


def decode_image(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.load()
    except FileNotFoundError:
        raise BadSample("missing_image", f"{path} does not exist") from None
    except Exception as err:
        raise BadSample("corrupt_image", f"{path} cannot be decoded ({type(err).__name__}: {err})") from None
    return image


def scale_to_pixel_limits(width: int, height: int, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """(width, height) after the optional pre-resize: scaled by sqrt(limit / area), sides truncated to ints."""
    if max_pixels is not None and width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    if min_pixels is not None and width * height < min_pixels:
        factor = math.sqrt(min_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    return width, height


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def size_value(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None
