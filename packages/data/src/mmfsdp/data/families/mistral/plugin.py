"""The `pixtral` image plugin (Pixtral / Mistral3 / Magistral).

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
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mmfsdp.config import ConfigError
from mmfsdp.data.errors import BadSample
from mmfsdp.data.plugins import (
    MediaSetting, decode_image, header_size, processor_file, read_json, register_plugin, scale_to_pixel_limits,
    setting_source, size_value,
)
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.video import VideoOptions

__all__ = ["PixtralPlugin", "pixtral_resized_size"]


def pixtral_resized_size(height: int, width: int, longest_edge: int, patch: int) -> tuple[int, int]:
    """(height, width) the HF Pixtral image processor resizes an image to (`patch` = patch size × merge size)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


@register_plugin
class PixtralPlugin:
    """Pixtral's image grid: `[IMG]` per cell, `[IMG_BREAK]` after each row, `[IMG_END]` last."""

    name = "pixtral"
    supports_video = False
    supports_audio = False
    image_token = "[IMG]"
    image_break_token = "[IMG_BREAK]"
    image_end_token = "[IMG_END]"

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `PixtralProcessor` around `tokenizer`, configured from the model directory.

        The image processor comes from `preprocessor_config.json` (or the `image_processor` section of
        `processor_config.json`, as transformers 5 saves it) when there is one, else
        from `tekken.json`'s image section or `config.json`'s vision config (Mistral ships
        some checkpoints with only those); patch and merge sizes likewise from
        `processor_config.json`, `config.json` or `tekken.json`.
        """
        from transformers import AutoImageProcessor, PixtralImageProcessor, PixtralProcessor

        processor_cfg = read_json(model_dir / "processor_config.json")
        model_cfg = read_json(model_dir / "config.json")
        vision_cfg = model_cfg.get("vision_config") or {}
        tekken = read_json(model_dir / "tekken.json")
        tekken_image = tekken.get("image") or tekken.get("multimodal") or {}
        patch_size = processor_cfg.get("patch_size") or vision_cfg.get("patch_size") or tekken_image.get("image_patch_size")
        merge = processor_cfg.get("spatial_merge_size") or model_cfg.get("spatial_merge_size") or tekken_image.get("spatial_merge_size") or 1
        if processor_file(model_dir, "image_processor", ("preprocessor_config.json",)) is not None:
            image_processor = AutoImageProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
            patch_size = patch_size or size_value(image_processor.patch_size, "height")
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

    @staticmethod
    def write_tiny_processor(out_dir: Path, *, image_size: int, patch_size: int, spatial_merge_size: int) -> None:
        """The synthetic data's hook: a tiny offline tokenizer + Pixtral processor (`synthetic.write_tiny_processor`)."""
        from mmfsdp.data.families.mistral.synthetic import write_tiny_processor

        write_tiny_processor(out_dir, image_size=image_size, patch_size=patch_size, spatial_merge_size=spatial_merge_size)

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None,
    ):
        hf = processor.hf_processor
        self.image_processor = processor.image_processor
        self.cell = int(hf.patch_size) * int(hf.spatial_merge_size)
        """Pixels per image token along each side: patch size × spatial merge size."""
        longest_edge = size_value(self.image_processor.size, "longest_edge")
        if longest_edge is None:
            raise ConfigError("data.dataset_param.preprocess_parameters.model_name_or_path", "the Pixtral image processor has no size.longest_edge")
        self.longest_edge = longest_edge
        self.model_dir = processor.name_or_path
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
        width, height = header_size(path)
        rows, cols = self.grid(width, height)
        if rows < 1 or cols < 1:
            raise BadSample("corrupt_image", f"{path} is {width}x{height}, too thin to resize to at least one image token")
        return rows, cols

    def _decode(self, path: str) -> Image.Image:
        image = decode_image(path)
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

    def media_settings(self) -> list[MediaSetting]:
        """The optional pre-resize limits and the image processor's `size.longest_edge`, each with its source."""
        model_dir = Path(self.model_dir)
        found = processor_file(model_dir, "image_processor", ("preprocessor_config.json",))
        if found is not None:
            source = setting_source(found, ("size",), self.image_processor, "size")
        else:
            source = "model directory: tekken.json image section or config.json vision_config.image_size"
        unset = "null: no pre-resize; image_processor.size.longest_edge applies"
        limits = {"image_max_pixels": self.image_max_pixels, "image_min_pixels": self.image_min_pixels}
        return [
            *(MediaSetting(key, value, unset if value is None else "config") for key, value in limits.items()),
            MediaSetting("image_processor.size.longest_edge", self.longest_edge, source),
        ]

    def describe(self, grid: tuple[int, ...]) -> str:
        rows, cols = grid
        return f"grid {rows}x{cols} -> {rows * cols} [IMG] + {rows} break/end = {rows * (cols + 1)} tokens"

    def label(self, grid: tuple[int, ...]) -> str:
        return "{}x{}".format(*grid)
