"""The `qwen3_vl` image and video plugin (alias `qwen2_vl`).

Images (the HF `Qwen2VLImageProcessor`, as Qwen2-VL, Qwen2.5-VL and Qwen3-VL use it):

1. HF's `smart_resize` rounds each side to a multiple of `patch_size × merge_size`
   and scales the area into [`image_min_pixels`, `image_max_pixels`] (each null = the
   image processor's own `size.shortest_edge` / `size.longest_edge`).
2. The grid is `(t, h, w)` in patches (`t = 1` for an image); the image becomes
   `<|vision_start|>`, `<|image_pad|> × t·h·w / merge²` (one per merged feature),
   `<|vision_end|>`.
3. `pixel_inputs` is the image processor's own output for the sample: `pixel_values`
   `[Σ t·h·w, C·T·P·P]` (patches flattened, `T` = temporal_patch_size) and
   `image_grid_thw` `[n, 3]`.

Videos (Qwen3-VL's semantics; the `Qwen3VLVideoProcessor` transformers loads from the model directory —
`processor_config.json`'s `video_processor` section, else `video_preprocessor_config.json`, else the image
processor's `preprocessor_config.json` — as `AutoProcessor.from_pretrained` does for inference):

1. The headers give frame count and rate; the frames are sampled by the video processor's
   own `sample_frames` at `video_fps`, at most `video_maxlen` (each null = the processor's
   own `fps` / `max_frames`, so that a config that sets neither samples what inference samples).
2. Each frame is scaled into [`video_min_pixels`, `video_max_pixels`] (the max lowered to
   the sample's share of `video_total_pixels`), then the video `smart_resize` sizes all
   frames together; the grid is `(ceil(frames / T), h, w)`.
3. The video becomes `<|vision_start|>`, per temporal group `<{t:.1f} seconds>`
   `<|vision_start|>` `<|video_pad|> × h·w / merge²` `<|vision_end|>`, then
   `<|vision_end|>` — what `Qwen3VLProcessor` (transformers 5) makes of the chat
   template's video item; `t` is the mean time of the group's first and last frame.
4. `video_inputs` is the video processor's own output on the decoded frames:
   `pixel_values_videos` `[Σ t·h·w, C·T·P·P]` and `video_grid_thw` `[n, 3]`.
"""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmfsdp.config import ConfigError
from mmfsdp.data.errors import BadSample
from mmfsdp.data.plugins import (
    MediaSetting, decode_image, header_size, processor_file, register_plugin, scale_to_pixel_limits, setting_source,
    size_value,
)
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.video import VideoInfo, VideoOptions, decode_frames, read_video_info

__all__ = ["Qwen3VLPlugin"]

_KEY = "data.dataset_param.preprocess_parameters"
_IMAGE_FILES = ("preprocessor_config.json",)
_VIDEO_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


@register_plugin
class Qwen3VLPlugin:
    """Qwen-VL's image tokens: `<|vision_start|>`, `<|image_pad|>` per merged feature, `<|vision_end|>`."""

    name = "qwen3_vl"
    aliases = ("qwen2_vl",)
    supports_video = True
    supports_audio = False
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"
    frames_at = 9
    """Where a video grid's sampled frame indices start (`read_video_grids`)."""

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `Qwen3VLProcessor` around `tokenizer`: the `Qwen2VLImageProcessor` and `Qwen3VLVideoProcessor` that
        transformers loads from the model directory (`processor_config.json`'s sections as transformers 5 saves
        them, else `preprocessor_config.json` and, for video, `video_preprocessor_config.json` before it; what the
        file lacks takes transformers' defaults)."""
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        cls.require_image_settings(model_dir)
        image_processor = Qwen2VLImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        video_processor = Qwen3VLVideoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)

    @classmethod
    def require_image_settings(cls, model_dir: Path) -> None:
        """A `ConfigError` unless the model directory holds the image processor's settings."""
        if processor_file(model_dir, "image_processor", _IMAGE_FILES) is None:
            raise ConfigError(
                f"{_KEY}.model_name_or_path",
                f"{str(model_dir)!r} has no preprocessor_config.json (nor processor_config.json with an "
                f"image_processor section, as transformers 5 saves it); the {cls.name} plugin needs the model's image "
                "processor settings",
            )

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None,
    ):
        self._init_images(processor, image_max_pixels, image_min_pixels)
        self._init_video(video or VideoOptions())

    def _init_images(self, processor: MMProcessor, image_max_pixels: int | None, image_min_pixels: int | None) -> None:
        """The image processor's settings and the vision tokens' ids."""
        self.processor = processor
        self.image_processor = processor.image_processor
        self.patch_size = int(self.image_processor.patch_size)
        self.merge_size = int(self.image_processor.merge_size)
        size = self.image_processor.size
        self.image_limits = (image_min_pixels, image_max_pixels)
        """`image_min_pixels`, `image_max_pixels` as configured (None: the image processor's)."""
        self.min_pixels = image_min_pixels or size_value(size, "shortest_edge")
        """Smallest resized area: `image_min_pixels`, else the image processor's `size.shortest_edge`."""
        self.max_pixels = image_max_pixels or size_value(size, "longest_edge")
        """Largest resized area: `image_max_pixels`, else the image processor's `size.longest_edge`."""
        if not (self.min_pixels and self.max_pixels):
            raise ConfigError(f"{_KEY}.model_name_or_path", "the Qwen2-VL image processor has no size.shortest_edge / size.longest_edge")
        tid = processor.token_id
        self.image_id = tid(self.image_token)
        self.start_id = tid(self.vision_start_token)
        self.end_id = tid(self.vision_end_token)
        self.video_id = tid(self.video_token)
        self.image_token_ids = frozenset((self.image_id, self.start_id, self.end_id, self.video_id))

    def _init_video(self, options: VideoOptions) -> None:
        """The video processor's settings, the configured ones applied."""
        self.video_options = options
        self.video_processor = getattr(self.processor.hf_processor, "video_processor", None)
        if self.video_processor is None:
            raise ConfigError(
                f"{_KEY}.image_plugin",
                "the qwen3_vl plugin needs an HF processor with a video_processor (Qwen3VLPlugin.load_hf_processor)",
            )
        vp = self.video_processor
        self.temporal_patch_size = int(vp.temporal_patch_size)
        self.video_patch_size = int(vp.patch_size)
        self.video_merge_size = int(vp.merge_size)
        self.video_size = (size_value(vp.size, "shortest_edge"), size_value(vp.size, "longest_edge"))
        """(min, max) pixels over all of a video's frames, the video processor's `size`."""
        self.cap_pixels_per_frame = bool(getattr(vp, "cap_pixels_per_frame", None))
        # `cap_pixels_per_frame` is newer than transformers 5.17: pass it only where the processor knows it, so
        # that both versions resize with the same (stated) setting and the newer one does not warn.
        known = getattr(getattr(vp, "valid_kwargs", None), "__annotations__", {})
        self._video_kwargs: dict[str, Any] = {"do_sample_frames": False, "return_tensors": "pt"}
        if "cap_pixels_per_frame" in known:
            self._video_kwargs["cap_pixels_per_frame"] = self.cap_pixels_per_frame
        self.video_fps = options.fps if options.fps is not None else vp.fps
        """Frames sampled per second: `video_fps`, else the video processor's `fps` (None: every frame)."""
        self.video_maxlen = options.maxlen if options.maxlen is not None else int(vp.max_frames)
        """Most frames sampled from one video: `video_maxlen`, else the video processor's `max_frames`."""
        self._sampler = copy.copy(vp)
        self._sampler.max_frames = self.video_maxlen

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of an image of this original size (HF's `smart_resize`; `ValueError` past aspect 200)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        resized_h, resized_w = smart_resize(height, width, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def read_grid(self, path: str) -> tuple[int, int, int]:
        width, height = header_size(path)
        try:
            return self.grid(width, height)
        except ValueError as err:
            raise BadSample("corrupt_image", f"{path} is {width}x{height}, which the Qwen2-VL image processor cannot resize ({err})") from None

    def image_tokens(self, grid: tuple[int, ...]) -> list[int]:
        return [self.start_id] + [self.image_id] * (math.prod(grid) // self.merge_size**2) + [self.end_id]

    def pixel_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """`pixel_values` `[Σ t·h·w, C·T·P·P]` and `image_grid_thw` `[n, 3]`, as the image processor returns them."""
        images = [decode_image(p) for p in paths]
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

    def media_settings(self) -> list[MediaSetting]:
        """Image pixel bounds, video sampling and video pixel limits as applied, each with its source."""
        return self.image_settings() + self.video_settings()

    def image_settings(self) -> list[MediaSetting]:
        """The image pixel bounds as applied, each with its source."""
        image_file = processor_file(Path(self.processor.name_or_path), "image_processor", _IMAGE_FILES)

        def image(key: str, explicit: int | None, value: int, legacy: str) -> MediaSetting:
            if explicit is not None:
                return MediaSetting(key, explicit, "config")
            return MediaSetting(key, value, setting_source(image_file, ("size", legacy), self.image_processor, "size"))

        return [
            image("image_min_pixels", self.image_limits[0], self.min_pixels, "min_pixels"),
            image("image_max_pixels", self.image_limits[1], self.max_pixels, "max_pixels"),
        ]

    def video_settings(self) -> list[MediaSetting]:
        """Video sampling and video pixel limits as applied, each with its source."""
        video_file = processor_file(Path(self.processor.name_or_path), "video_processor", _VIDEO_FILES)
        vp, options = self.video_processor, self.video_options

        def video(key: str, explicit: Any, value: Any, name: str) -> MediaSetting:
            if explicit is not None:
                return MediaSetting(key, explicit, "config")
            return MediaSetting(key, value, setting_source(video_file, (name,), vp, name))

        no_limit = "null: no per-frame limit; video_processor.size applies"
        return [
            video("video_fps", options.fps, self.video_fps, "fps"),
            video("video_maxlen", options.maxlen, self.video_maxlen, "max_frames"),
            video("video_processor.min_frames", None, int(vp.min_frames), "min_frames"),
            video("video_processor.size", None, dict(zip(("shortest_edge", "longest_edge"), self.video_size)), "size"),
            video("video_processor.cap_pixels_per_frame", None, self.cap_pixels_per_frame, "cap_pixels_per_frame"),
            MediaSetting("video_max_pixels", options.max_pixels, no_limit if options.max_pixels is None else "config"),
            MediaSetting("video_min_pixels", options.min_pixels, no_limit if options.min_pixels is None else "config"),
            MediaSetting("video_total_pixels", options.total_pixels,
                         "null: no budget per sample" if options.total_pixels is None else "config"),
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
        return [int(i) for i in self._sampler.sample_frames(metadata, fps=self.video_fps)]

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
                    f"{path} gives {len(frames)} sampled frame(s) ({info.num_frames} in all); the {self.name} plugin "
                    f"needs at least temporal_patch_size = {self.temporal_patch_size}",
                )
            width, height = scale_to_pixel_limits(info.width, info.height, frame_max, self.video_options.min_pixels)
            if width < 1 or height < 1:
                detail = f"{path} is {info.width}x{info.height}, too thin to scale to the video pixel limits"
                raise BadSample("unsupported_video", detail)
            try:
                resized_h, resized_w = self.video_resize(len(frames), height, width)
            except ValueError as err:
                detail = f"{path} is {info.width}x{info.height}, which the {self.name} plugin's video resize cannot"
                detail += f" handle ({err})"
                raise BadSample("unsupported_video", detail) from None
            t = -(-len(frames) // self.temporal_patch_size)
            patches = (t, resized_h // self.video_patch_size, resized_w // self.video_patch_size)
            sizes = (info.width, info.height, width, height)
            grids.append((*patches, *sizes, info.fps.numerator, info.fps.denominator, *frames))
        return grids

    def frame_times(self, grid: tuple[int, ...]) -> list[float]:
        """Seconds of each sampled frame of a video grid."""
        fps = float(Fraction(grid[7], grid[8]))
        return [index / fps for index in grid[self.frames_at :]]

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
            frames = decode_frames(path, list(grid[self.frames_at :]), timeout_s=self.video_options.timeout_s)
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
            f"{len(grid) - self.frames_at} frames at {times} s ({grid[5]}x{grid[6]} px) -> grid {t}x{h}x{w} patches -> "
            f"{n} <|video_pad|> in {t} groups, {len(self.video_tokens(grid))} tokens with timestamps"
        )

    def video_label(self, grid: tuple[int, ...]) -> str:
        return "x".join(str(g) for g in grid[:3]) + f" {len(grid) - self.frames_at} frames"
