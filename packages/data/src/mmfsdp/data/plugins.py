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
- `image_token_ids` -> the ids that belong to image blocks (never trained, never cut).

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

Pixels are decoded only in `pixel_inputs`, i.e. in DataLoader workers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from PIL import Image

from mmfsdp.config import ConfigError, Registry

from mmfsdp.data.errors import BadSample
from mmfsdp.data.processor import MMProcessor

__all__ = [
    "ImagePlugin",
    "PixtralPlugin",
    "Qwen2VLPlugin",
    "get_plugin",
    "pixtral_resized_size",
    "plugin_names",
    "register_plugin",
    "scale_to_pixel_limits",
]

_KEY = "data.dataset_param.preprocess_parameters"


@runtime_checkable
class ImagePlugin(Protocol):
    """What the dataset needs from a model family's image handling (see the module docstring)."""

    name: ClassVar[str]
    """The name users write in `preprocess_parameters.image_plugin`."""
    image_token_ids: frozenset[int]
    """Ids that belong to image blocks (never trained, never cut)."""

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """The HF multimodal processor around `tokenizer` (it holds the image processor), from the model directory."""
        ...

    def __init__(self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None): ...

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


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _size_value(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None


@register_plugin
class PixtralPlugin:
    """Pixtral's image grid: `[IMG]` per cell, `[IMG_BREAK]` after each row, `[IMG_END]` last."""

    name = "pixtral"
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

    def __init__(self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None):
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
    image_token = "<|image_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `Qwen2VLProcessor` around `tokenizer` with the `Qwen2VLImageProcessor` of `preprocessor_config.json`."""
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        if not (model_dir / "preprocessor_config.json").is_file():
            raise ConfigError(f"{_KEY}.model_name_or_path", f"{str(model_dir)!r} has no preprocessor_config.json; the qwen2_vl plugin needs the model's image processor settings")
        image_processor = Qwen2VLImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())

    def __init__(self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None):
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
        self.image_token_ids = frozenset((self.image_id, self.start_id, self.end_id))

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
        """`mm_token_type_ids`: 1 on `<|image_pad|>`, 0 elsewhere (what `Qwen3VLProcessor` returns)."""
        return {"mm_token_type_ids": (input_ids == self.image_id).long()}

    def fingerprint(self) -> list[Any]:
        return [self.name, self.patch_size, self.merge_size, self.min_pixels, self.max_pixels]

    def describe(self, grid: tuple[int, ...]) -> str:
        t, h, w = grid
        n = t * h * w // self.merge_size**2
        return f"grid {t}x{h}x{w} patches -> {n} <|image_pad|> + start/end = {n + 2} tokens"

    def label(self, grid: tuple[int, ...]) -> str:
        return "x".join(str(g) for g in grid)
