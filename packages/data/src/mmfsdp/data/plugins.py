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
- `image_token_ids` -> the ids that belong to image (and video) blocks (never trained, never cut).
- `supports_video` -> whether it also implements `VideoPlugin`: `read_video_grids(paths)`
  (preprocessing, headers only: samples the frames), `video_tokens(grid)`,
  `video_inputs(paths, grids)` (workers: decodes only the sampled frames, bounded in
  time by `video_timeout`, see `mmfsdp.data.video`). A video row for a plugin without it
  is a bad row (`video_not_supported`).

`pixtral` (Pixtral / Mistral3 / Magistral):

1. Optional pre-resize: `image_max_pixels` / `image_min_pixels` scale the image (aspect
   ratio kept, `int()` of the scaled sides, bicubic) before anything else sees it.
2. The HF Pixtral image processor resizes so the longest edge is at most
   `size.longest_edge` (floor of the scaled sides), then rounds each side *up* to a
   multiple of `patch_size × spatial_merge_size` (= `P`), exactly as
   `PixtralProcessor` calls it. `grid(height, width)` reproduces that arithmetic from
   the image's header size, so token counts are known without decoding pixels.
3. An image of `rows × cols` cells (`rows = H // P`, `cols = W // P`) becomes, row by
   row, `[IMG] × cols` then `[IMG_BREAK]`, with the very last token replaced by
   `[IMG_END]`: `rows × (cols + 1)` tokens, of which `rows × cols` are `[IMG]` — one per
   image feature the vision tower + patch merger produce. The grid is `(rows, cols)`.

Its `pixel_inputs` are unpadded per-image `[3, h, w]` tensors (`pixel_values`) and
`image_sizes` `[n, 2]`; the collator pads them the way the HF image processor pads a
batch (zeros at the bottom/right up to the batch's largest side).

`qwen2_vl` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the HF `Qwen2VLImageProcessor`):

1. HF's `smart_resize` rounds each side to a multiple of `patch_size × merge_size`
   and scales the area into [`image_min_pixels`, `image_max_pixels`] (each null = the
   image processor's own `size.shortest_edge` / `size.longest_edge`).
2. The grid is `(t, h, w)` in patches (`t = 1` for an image); the image becomes
   `<|vision_start|>`, `<|image_pad|> × t·h·w / merge²` (one per merged feature),
   `<|vision_end|>`.
3. `pixel_inputs` is the image processor's own output for the sample: `pixel_values`
   `[Σ t·h·w, C·T·P·P]` (patches flattened, `T` = temporal_patch_size) and
   `image_grid_thw` `[n, 3]`.

Videos (Qwen3-VL's semantics; `Qwen3VLVideoProcessor` from `video_preprocessor_config.json`,
else one with the image processor's settings):

1. The headers give frame count and rate; the frames are sampled by the video processor's
   own `sample_frames` at `video_fps`, at most `video_maxlen`.
2. Each frame is scaled into [`video_min_pixels`, `video_max_pixels`] (the max lowered to
   the sample's share of `video_total_pixels`), then the video `smart_resize` sizes all
   frames together; the grid is `(ceil(frames / T), h, w)`.
3. The video becomes `<|vision_start|>`, per temporal group `<{t:.1f} seconds>`
   `<|vision_start|>` `<|video_pad|> × h·w / merge²` `<|vision_end|>`, then
   `<|vision_end|>` — what `Qwen3VLProcessor` (transformers 5) makes of the chat
   template's video item; `t` is the mean time of the group's first and last frame.
4. `video_inputs` is the video processor's own output on the decoded frames:
   `pixel_values_videos` `[Σ t·h·w, C·T·P·P]` and `video_grid_thw` `[n, 3]`.

Pixels are decoded only in `pixel_inputs` / `video_inputs`, i.e. in DataLoader workers.
"""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image

from mmfsdp.config import ConfigError, Registry

from mmfsdp.data.errors import BadSample
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.video import VideoInfo, VideoOptions, decode_frames, read_video_info

__all__ = [
    "ImagePlugin",
    "PixtralPlugin",
    "VideoPlugin",
    "Qwen2VLPlugin",
    "get_plugin",
    "pixtral_resized_size",
    "plugin_names",
    "register_plugin",
    "scale_to_pixel_limits",
    "video_settings_of",
]

_KEY = "data.dataset_param.preprocess_parameters"


@runtime_checkable
class ImagePlugin(Protocol):
    """What the dataset needs from a model family's image handling (see the module docstring)."""

    name: ClassVar[str]
    """The name users write in `preprocess_parameters.image_plugin`."""
    image_token_ids: frozenset[int]
    """Ids that belong to image (and video) blocks (never trained, never cut)."""
    supports_video: ClassVar[bool]
    """Whether the plugin also implements `VideoPlugin`; a video row of a plugin without it is `video_not_supported`."""

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


_PLUGINS: Registry[type[ImagePlugin]] = Registry("image plugin", f"{_KEY}.image_plugin")


def register_plugin(cls: type) -> type:
    return _PLUGINS.register(cls.name, cls)


def plugin_names() -> list[str]:
    return _PLUGINS.names()


def get_plugin(name: str) -> type[ImagePlugin]:
    return _PLUGINS.get(name)


def _header_size(path: str) -> tuple[int, int]:
    """(width, height) of the image file at `path` from its header only; `BadSample` if missing/unreadable."""
    if not Path(path).is_file():
        raise BadSample("missing_image", f"{path} does not exist")
    try:
        with Image.open(path) as image:
            return image.size
    except Exception as err:  # PIL raises many types for unreadable files
        raise BadSample("corrupt_image", f"{path} is not a readable image ({type(err).__name__}: {err})") from None


def _decode(path: str) -> Image.Image:
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


def pixtral_resized_size(height: int, width: int, longest_edge: int, patch: int) -> tuple[int, int]:
    """(height, width) the HF Pixtral image processor resizes an image to (`patch` = patch size × merge size)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


def video_settings_of(image_processor: Any) -> dict[str, Any]:
    """`Qwen3VLVideoProcessor` keywords matching a Qwen-VL image processor, for models that ship no video config."""
    size = image_processor.size
    return {
        "patch_size": int(image_processor.patch_size),
        "temporal_patch_size": int(image_processor.temporal_patch_size),
        "merge_size": int(image_processor.merge_size),
        "size": {key: _size_value(size, key) for key in ("shortest_edge", "longest_edge")},
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
    }


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _size_value(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None


@register_plugin
class PixtralPlugin:
    """Pixtral's image grid: `[IMG]` per cell, `[IMG_BREAK]` after each row, `[IMG_END]` last."""

    name = "pixtral"
    supports_video = False
    image_token = "[IMG]"
    image_break_token = "[IMG_BREAK]"
    image_end_token = "[IMG_END]"

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `PixtralProcessor` around `tokenizer`, configured from the model directory.

        The image processor comes from `preprocessor_config.json` when there is one, else
        from `tekken.json`'s image section or `config.json`'s vision config (Mistral ships
        some checkpoints with only those); patch and merge sizes likewise from
        `processor_config.json`, `config.json` or `tekken.json`.
        """
        from transformers import AutoImageProcessor, PixtralImageProcessor, PixtralProcessor

        processor_cfg = _read_json(model_dir / "processor_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        vision_cfg = model_cfg.get("vision_config") or {}
        tekken = _read_json(model_dir / "tekken.json")
        tekken_image = tekken.get("image") or tekken.get("multimodal") or {}
        patch_size = processor_cfg.get("patch_size") or vision_cfg.get("patch_size") or tekken_image.get("image_patch_size")
        merge = processor_cfg.get("spatial_merge_size") or model_cfg.get("spatial_merge_size") or tekken_image.get("spatial_merge_size") or 1
        if (model_dir / "preprocessor_config.json").is_file():
            image_processor = AutoImageProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
            patch_size = patch_size or _size_value(image_processor.patch_size, "height")
        else:
            longest_edge = tekken_image.get("max_image_size") or vision_cfg.get("image_size")
            if not (patch_size and longest_edge):
                raise ConfigError(
                    "data.dataset_param.preprocess_parameters.model_name_or_path",
                    f"{str(model_dir)!r} has no preprocessor_config.json and no image settings in tekken.json or config.json; "
                    "the pixtral plugin cannot build an image processor for it",
                )
            image_processor = PixtralImageProcessor(patch_size={"height": patch_size, "width": patch_size}, size={"longest_edge": longest_edge})
        if not patch_size:
            raise ConfigError("data.dataset_param.preprocess_parameters.model_name_or_path", f"cannot find the vision patch size in {str(model_dir)!r}")
        return PixtralProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=int(patch_size),
            spatial_merge_size=int(merge),
            image_token=processor_cfg.get("image_token", cls.image_token),
            image_break_token=processor_cfg.get("image_break_token", cls.image_break_token),
            image_end_token=processor_cfg.get("image_end_token", cls.image_end_token),
        )

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None,
    ):
        hf = processor.hf_processor
        self.image_processor = processor.image_processor
        self.cell = int(hf.patch_size) * int(hf.spatial_merge_size)
        """Pixels per image token along each side: patch size × spatial merge size."""
        longest_edge = _size_value(self.image_processor.size, "longest_edge")
        if longest_edge is None:
            raise ConfigError("data.dataset_param.preprocess_parameters.model_name_or_path", "the Pixtral image processor has no size.longest_edge")
        self.longest_edge = longest_edge
        self.image_max_pixels = image_max_pixels
        self.image_min_pixels = image_min_pixels
        self.image_id = processor.token_id(getattr(hf, "image_token", self.image_token))
        self.break_id = processor.token_id(getattr(hf, "image_break_token", self.image_break_token))
        self.end_id = processor.token_id(getattr(hf, "image_end_token", self.image_end_token))
        self.image_token_ids = frozenset((self.image_id, self.break_id, self.end_id))
        """Ids that belong to image blocks (never trained, never cut)."""

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of image tokens for an image of this original size."""
        width, height = scale_to_pixel_limits(width, height, self.image_max_pixels, self.image_min_pixels)
        if width < 1 or height < 1:
            return 0, 0
        resized_h, resized_w = pixtral_resized_size(height, width, self.longest_edge, self.cell)
        return resized_h // self.cell, resized_w // self.cell

    def image_tokens(self, grid: tuple[int, ...]) -> list[int]:
        rows, cols = grid
        tokens = ([self.image_id] * cols + [self.break_id]) * rows
        tokens[-1] = self.end_id
        return tokens

    def read_grid(self, path: str) -> tuple[int, int]:
        """(rows, cols) of the image file at `path` from its header only; `BadSample` if missing/unreadable."""
        width, height = _header_size(path)
        rows, cols = self.grid(width, height)
        if rows < 1 or cols < 1:
            raise BadSample("corrupt_image", f"{path} is {width}x{height}, too thin to resize to at least one image token")
        return rows, cols

    def _decode(self, path: str) -> Image.Image:
        image = _decode(path)
        width, height = scale_to_pixel_limits(image.width, image.height, self.image_max_pixels, self.image_min_pixels)
        if (width, height) != image.size:
            if image.mode != "RGB":
                image = image.convert("RGB")
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        return image

    def load_images(self, paths: list[str], grids: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Decode and process one sample's images: unpadded `[3, h, w]` float tensors and `image_sizes` `[n, 2]`."""
        images = [self._decode(p) for p in paths]
        out = self.image_processor(images, patch_size=self.cell, return_tensors="pt")
        sizes = torch.as_tensor(out["image_sizes"], dtype=torch.long).reshape(-1, 2)
        pixel_values = []
        for i, (path, (rows, cols)) in enumerate(zip(paths, grids)):
            h, w = int(sizes[i, 0]), int(sizes[i, 1])
            if (h // self.cell, w // self.cell) != (rows, cols):
                raise BadSample("corrupt_image", f"{path} now gives a {h // self.cell}x{w // self.cell} grid, not the {rows}x{cols} it was tokenized with; clear the cache")
            pixel_values.append(out["pixel_values"][i][:, :h, :w].contiguous())
        return pixel_values, sizes

    def pixel_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        pixel_values, image_sizes = self.load_images(paths, grids)
        return {"pixel_values": pixel_values, "image_sizes": image_sizes}

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def fingerprint(self) -> list[Any]:
        return [self.name, self.cell, self.longest_edge, self.image_max_pixels, self.image_min_pixels]

    def describe(self, grid: tuple[int, ...]) -> str:
        rows, cols = grid
        return f"grid {rows}x{cols} -> {rows * cols} [IMG] + {rows} break/end = {rows * (cols + 1)} tokens"

    def label(self, grid: tuple[int, ...]) -> str:
        return "{}x{}".format(*grid)


@register_plugin
class Qwen2VLPlugin:
    """Qwen-VL's image tokens: `<|vision_start|>`, `<|image_pad|>` per merged feature, `<|vision_end|>`."""

    name = "qwen2_vl"
    supports_video = True
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `Qwen3VLProcessor` around `tokenizer`: the `Qwen2VLImageProcessor` of `preprocessor_config.json` and the
        `Qwen3VLVideoProcessor` of `video_preprocessor_config.json` (without one: the image processor's patch, merge,
        temporal patch, size, mean and std settings)."""
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        if not (model_dir / "preprocessor_config.json").is_file():
            raise ConfigError(f"{_KEY}.model_name_or_path", f"{str(model_dir)!r} has no preprocessor_config.json; the qwen2_vl plugin needs the model's image processor settings")
        image_processor = Qwen2VLImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        if (model_dir / "video_preprocessor_config.json").is_file():
            video_processor = Qwen3VLVideoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        else:
            video_processor = Qwen3VLVideoProcessor(**video_settings_of(image_processor))
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None,
    ):
        self.processor = processor
        self.image_processor = processor.image_processor
        self.patch_size = int(self.image_processor.patch_size)
        self.merge_size = int(self.image_processor.merge_size)
        size = self.image_processor.size
        self.min_pixels = image_min_pixels or _size_value(size, "shortest_edge")
        """Smallest resized area: `image_min_pixels`, else the image processor's `size.shortest_edge`."""
        self.max_pixels = image_max_pixels or _size_value(size, "longest_edge")
        """Largest resized area: `image_max_pixels`, else the image processor's `size.longest_edge`."""
        if not (self.min_pixels and self.max_pixels):
            raise ConfigError(f"{_KEY}.model_name_or_path", "the Qwen2-VL image processor has no size.shortest_edge / size.longest_edge")
        tid = processor.token_id
        self.image_id = tid(self.image_token)
        self.start_id = tid(self.vision_start_token)
        self.end_id = tid(self.vision_end_token)
        self.video_id = tid(self.video_token)
        self.image_token_ids = frozenset((self.image_id, self.start_id, self.end_id, self.video_id))
        self.video_options = video or VideoOptions()
        self.video_processor = getattr(processor.hf_processor, "video_processor", None)
        if self.video_processor is None:
            raise ConfigError(
                f"{_KEY}.image_plugin",
                "the qwen2_vl plugin needs an HF processor with a video_processor (Qwen2VLPlugin.load_hf_processor)",
            )
        vp = self.video_processor
        self.temporal_patch_size = int(vp.temporal_patch_size)
        self.video_patch_size = int(vp.patch_size)
        self.video_merge_size = int(vp.merge_size)
        self.video_size = (_size_value(vp.size, "shortest_edge"), _size_value(vp.size, "longest_edge"))
        """(min, max) pixels over all of a video's frames, the video processor's `size`."""
        self.cap_pixels_per_frame = bool(getattr(vp, "cap_pixels_per_frame", None))
        # `cap_pixels_per_frame` is newer than transformers 5.17: pass it only where the processor knows it, so
        # that both versions resize with the same (stated) setting and the newer one does not warn.
        known = getattr(getattr(vp, "valid_kwargs", None), "__annotations__", {})
        self._video_kwargs: dict[str, Any] = {"do_sample_frames": False, "return_tensors": "pt"}
        if "cap_pixels_per_frame" in known:
            self._video_kwargs["cap_pixels_per_frame"] = self.cap_pixels_per_frame
        self._sampler = copy.copy(vp)
        self._sampler.max_frames = self.video_options.maxlen

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of an image of this original size (HF's `smart_resize`; `ValueError` past aspect 200)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        resized_h, resized_w = smart_resize(height, width, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def read_grid(self, path: str) -> tuple[int, int, int]:
        width, height = _header_size(path)
        try:
            return self.grid(width, height)
        except ValueError as err:
            raise BadSample("corrupt_image", f"{path} is {width}x{height}, which the Qwen2-VL image processor cannot resize ({err})") from None

    def image_tokens(self, grid: tuple[int, ...]) -> list[int]:
        return [self.start_id] + [self.image_id] * (math.prod(grid) // self.merge_size**2) + [self.end_id]

    def pixel_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """`pixel_values` `[Σ t·h·w, C·T·P·P]` and `image_grid_thw` `[n, 3]`, as the image processor returns them."""
        images = [_decode(p) for p in paths]
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        out = self.image_processor(images, size=size, return_tensors="pt")
        grid_thw = torch.as_tensor(out["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
        for path, grid, got in zip(paths, grids, grid_thw.tolist()):
            if tuple(got) != tuple(grid):
                raise BadSample("corrupt_image", f"{path} now gives a {got} grid, not the {list(grid)} it was tokenized with; clear the cache")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid_thw}

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """`mm_token_type_ids`: 1 on `<|image_pad|>`, 2 on `<|video_pad|>`, 0 elsewhere (as `Qwen3VLProcessor`)."""
        return {"mm_token_type_ids": (input_ids == self.image_id).long() + 2 * (input_ids == self.video_id).long()}

    def fingerprint(self) -> list[Any]:
        video = self.video_processor.to_dict()
        return [
            self.name,
            self.patch_size,
            self.merge_size,
            self.min_pixels,
            self.max_pixels,
            type(self.video_processor).__name__,
            json.loads(json.dumps(video, sort_keys=True, default=str)),
            repr(self.video_options),
            self._video_kwargs,
        ]

    def describe(self, grid: tuple[int, ...]) -> str:
        t, h, w = grid
        n = t * h * w // self.merge_size**2
        return f"grid {t}x{h}x{w} patches -> {n} <|image_pad|> + start/end = {n + 2} tokens"

    def label(self, grid: tuple[int, ...]) -> str:
        return "x".join(str(g) for g in grid)

    # ---------------------------------------------------------------- video (Qwen3-VL)

    def sample_indices(self, info: VideoInfo) -> list[int]:
        """The frames Qwen3-VL's video processor samples from a video with these headers (its own `sample_frames`,
        at `video_fps`, at most `video_maxlen` frames)."""
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(
            total_num_frames=info.num_frames, fps=float(info.fps), width=info.width, height=info.height,
            duration=info.duration,
        )
        return [int(i) for i in self._sampler.sample_frames(metadata, fps=self.video_options.fps)]

    def video_resize(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) the video processor resizes `num_frames` frames of this size to (its `smart_resize`)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        factor = self.video_patch_size * self.video_merge_size
        min_pixels, max_pixels = self.video_size
        if self.cap_pixels_per_frame:
            frame_cap = int(getattr(self.video_processor, "max_video_tokens", 768)) * factor * factor
            max_pixels = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05)) * num_frames
        return smart_resize(
            num_frames, height, width, temporal_factor=self.temporal_patch_size, factor=factor,
            min_pixels=min_pixels, max_pixels=max_pixels,
        )

    def read_video_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        """Per video: `(t, h, w, width, height, frame_width, frame_height, fps_num, fps_den, *frame_indices)`.

        `t, h, w` is the patch grid, `width × height` the header's frame size, `frame_width × frame_height` the
        size after the per-frame pixel limits (what the video processor is given)."""
        timeout_s = self.video_options.timeout_s
        infos = [read_video_info(path, timeout_s=timeout_s) for path in paths]
        indices = [self.sample_indices(info) for info in infos]
        frame_max = self.video_options.frame_max_pixels(sum(map(len, indices)))
        grids = []
        for path, info, frames in zip(paths, infos, indices):
            if len(frames) < self.temporal_patch_size:
                raise BadSample(
                    "unsupported_video",
                    f"{path} gives {len(frames)} sampled frame(s) ({info.num_frames} in all); Qwen3-VL needs at least "
                    f"temporal_patch_size = {self.temporal_patch_size}",
                )
            width, height = scale_to_pixel_limits(info.width, info.height, frame_max, self.video_options.min_pixels)
            if width < 1 or height < 1:
                detail = f"{path} is {info.width}x{info.height}, too thin to scale to the video pixel limits"
                raise BadSample("unsupported_video", detail)
            try:
                resized_h, resized_w = self.video_resize(len(frames), height, width)
            except ValueError as err:
                detail = f"{path} is {info.width}x{info.height}, which the Qwen3-VL video processor cannot resize"
                detail += f" ({err})"
                raise BadSample("unsupported_video", detail) from None
            t = -(-len(frames) // self.temporal_patch_size)
            patches = (t, resized_h // self.video_patch_size, resized_w // self.video_patch_size)
            sizes = (info.width, info.height, width, height)
            grids.append((*patches, *sizes, info.fps.numerator, info.fps.denominator, *frames))
        return grids

    def frame_times(self, grid: tuple[int, ...]) -> list[float]:
        """Seconds of each sampled frame of a video grid."""
        fps = float(Fraction(grid[7], grid[8]))
        return [index / fps for index in grid[9:]]

    def group_times(self, grid: tuple[int, ...]) -> list[float]:
        """The timestamp of each temporal group, as `Qwen3VLProcessor` computes it: the mean of its first and last
        frame's time, the last frame repeated to fill the last group."""
        times = self.frame_times(grid)
        size = self.temporal_patch_size
        times += times[-1:] * (-len(times) % size)
        return [(times[i] + times[i + size - 1]) / 2 for i in range(0, len(times), size)]

    def video_tokens(self, grid: tuple[int, ...]) -> list[int]:
        """`<|vision_start|>`, then per temporal group
        `<{t:.1f} seconds><|vision_start|><|video_pad|>×n<|vision_end|>`, then `<|vision_end|>`: transformers'
        expansion of the chat template's `<|vision_start|><|video_pad|><|vision_end|>` (it replaces only the pad, so
        the outer pair stays)."""
        t, h, w = grid[:3]
        per_group = h * w // self.video_merge_size**2
        stamps = self.processor.encode_texts([f"<{time:.1f} seconds>" for time in self.group_times(grid)])
        assert len(stamps) == t, (len(stamps), t)
        ids = [self.start_id]
        for stamp in stamps:
            ids += stamp + [self.start_id] + [self.video_id] * per_group + [self.end_id]
        return ids + [self.end_id]

    def video_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """`pixel_values_videos` `[Σ t·h·w, C·T·P·P]` and `video_grid_thw` `[n, 3]`, as the video processor
        returns them for the decoded sampled frames."""
        videos = []
        for path, grid in zip(paths, grids):
            width, height, frame_w, frame_h = grid[3:7]
            frames = decode_frames(path, list(grid[9:]), timeout_s=self.video_options.timeout_s)
            if frames.shape[1:3] != (height, width):
                detail = f"{path} decodes to {frames.shape[2]}x{frames.shape[1]} frames, not its header's"
                detail += f" {width}x{height}"
                raise BadSample("corrupt_video", detail)
            if (frame_w, frame_h) != (width, height):
                resize = Image.Resampling.BICUBIC
                frames = np.stack([np.asarray(Image.fromarray(f).resize((frame_w, frame_h), resize)) for f in frames])
            videos.append(frames)
        out = self.video_processor(videos=videos, **self._video_kwargs)
        grid_thw = torch.as_tensor(out["video_grid_thw"], dtype=torch.long).reshape(-1, 3)
        for path, grid, got in zip(paths, grids, grid_thw.tolist()):
            if tuple(got) != tuple(grid[:3]):
                detail = f"{path} now gives a {got} grid, not the {list(grid[:3])} it was tokenized with"
                detail += "; clear the cache"
                raise BadSample("corrupt_video", detail)
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid_thw}

    def describe_video(self, grid: tuple[int, ...]) -> str:
        t, h, w = grid[:3]
        n = t * h * w // self.video_merge_size**2
        times = ", ".join(f"{time:.2f}" for time in self.frame_times(grid))
        return (
            f"{len(grid) - 9} frames at {times} s ({grid[5]}x{grid[6]} px) -> grid {t}x{h}x{w} patches -> "
            f"{n} <|video_pad|> in {t} groups, {len(self.video_tokens(grid))} tokens with timestamps"
        )

    def video_label(self, grid: tuple[int, ...]) -> str:
        return "x".join(str(g) for g in grid[:3]) + f" {len(grid) - 9} frames"
