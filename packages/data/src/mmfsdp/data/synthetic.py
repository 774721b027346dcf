"""Synthetic data for the project's tiny end-to-end run: coloured shapes and a tiny offline processor.

`make_shapes_dataset` draws one shape (circle / square / triangle) in one colour
(red / green / blue / yellow) per PNG, at a random position and size over a noisy
grey background, so a model must really look at the pixels to answer
"What shape and colour is this?" with e.g. "a red circle" (chance: 1/12).

With `text_only_share` > 0, that share of the *training* rows has no image and asks a
text question instead ("What colour is a banana?" -> "yellow": a fixed object -> colour
lookup, learnable from text alone and worded unlike the image question, so it never makes
the image question ambiguous). The evaluation split stays image-only, so the held-out
accuracy and its chance keep their meaning.

`make_varlen_dataset` writes a test set of the same images and words whose rows vary:
0-2 images of several sizes, 1-3 turns, answers of 1-15 words. Parity tests use it,
because equal-length samples hide what padding and packing do to a batch.

The dataset types `synthetic_shapes` and `synthetic_shapes_pairs` (registered in `mmfsdp.data.dataset_types`)
are `prepare_synthetic` / `prepare_synthetic_pairs`, which generate the data where `basic_parameters.dataset_dir`
says, and `synthetic_files` / `synthetic_pair_files`, which list its splits.
When `preprocess_parameters.model_name_or_path` does not exist, `prepare_dataset` asks the
configured image plugin to write a tiny offline processor there holding `WORDS` (its optional
`write_tiny_processor` hook; a family's own files live in its folder).

Both generators write into a temporary sibling directory and rename it into place, so several
ranks may call them at once: one rename wins, the others find the result.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from PIL import Image, ImageDraw

from mmfsdp.config import ConfigError

from mmfsdp.data.errors import DataError

if TYPE_CHECKING:
    from mmfsdp.data.config import DataConfig

__all__ = [
    "COLOURS", "DIRECTIONS", "MOTION_PROMPT", "PROMPT", "SHAPES", "TEXT_ONLY_OBJECTS", "VARLEN_IMAGE_SIZES", "WORDS",
    "make_motion_dataset", "make_shapes_dataset", "make_varlen_dataset", "prepare_synthetic", "prepare_synthetic_pairs",
    "synthetic_files", "synthetic_pair_files", "write_moving_shape_clip",
]

COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 60, 220), "yellow": (235, 215, 30)}
SHAPES = ("circle", "square", "triangle")
PROMPT = "<image>What shape and colour is this?"
TEXT_ONLY_OBJECTS = {
    "a banana": "yellow", "a lemon": "yellow", "a tomato": "red", "a cherry": "red",
    "a leaf": "green", "a frog": "green", "the sky": "blue", "the sea": "blue",
}
"""The text-only task: "What colour is {object}?" -> its colour."""

WORDS = (
    "a", *COLOURS, *SHAPES, "What", "shape", "and", "colour", "is", "this", "?",
    "the", *dict.fromkeys(obj.split()[1] for obj in TEXT_ONLY_OBJECTS),
)
"""The words of the synthetic data: a tiny tokenizer for it must hold every one."""


def _publish(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` on a fresh temporary sibling of `out_dir`, then rename it to `out_dir` unless someone already did."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _existing_meta(out_dir: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The meta of data already generated in `out_dir`, or None; an error if it was generated with other settings.

    Generated data is reused only when every generator setting matches (a missing `text_only_share`
    means 0, as data from before that setting had none), so a changed setting is never silently ignored.
    """
    path = out_dir / "meta.json"
    if not path.is_file():
        return None
    existing = json.loads(path.read_text())
    differs = {k: (existing.get(k, 0.0 if k == "text_only_share" else None), v) for k, v in meta.items()}
    differs = {k: pair for k, pair in differs.items() if pair[0] != pair[1]}
    if differs:
        from mmfsdp.data.errors import DataError

        settings = ", ".join(f"{k}: {old!r} there, {new!r} asked" for k, (old, new) in differs.items())
        raise DataError(
            f"{out_dir} holds synthetic data generated with other settings ({settings}); delete the directory "
            "to regenerate it, or point basic_parameters.dataset_dir elsewhere"
        )
    return existing


def _text_only_rows(count: int, share: float, seed: int) -> set[int]:
    """The row indices (of `count`) that are text-only: exactly round(share × count) of them, chosen from `seed`."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"text_only_share must be in [0, 1), got {share}")
    rng = np.random.default_rng([seed, 1])  # a stream of its own: share 0 leaves the image rows as they were
    return set(rng.permutation(count)[: round(share * count)].tolist())


def _draw(rng: np.random.Generator, colour: str, shape: str, width: int, height: int) -> Image.Image:
    """One shape, large and near the centre (a few pixels of jitter), on a random flat grey background.

    Colour is readable from any patch; the shape only from how the patches fit together,
    so the default run has to learn the vision path, yet a few-M-parameter model learns it
    in a few hundred steps on a CPU. The shape's side follows the shorter image side.
    """
    grey = int(rng.integers(70, 180))
    image = Image.new("RGB", (width, height), (grey, grey, grey))
    short = min(width, height)
    side = int(rng.integers(int(short * 0.5), int(short * 0.85) + 1))
    jitter = max(short // 16, 1)
    x0 = int(np.clip((width - side) // 2 + rng.integers(-jitter, jitter + 1), 0, width - side))
    y0 = int(np.clip((height - side) // 2 + rng.integers(-jitter, jitter + 1), 0, height - side))
    draw = ImageDraw.Draw(image)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    return image


DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Directions a clip's shape moves in, as (dx, dy) in image coordinates (y grows downwards)."""


def write_moving_shape_clip(
    path: str | Path,
    rng: np.random.Generator,
    *,
    colour: str,
    shape: str,
    direction: str,
    width: int,
    height: int,
    num_frames: int,
    fps: int,
    codec: str = "mpeg4",
    shape_share: float = 1 / 3,
    noise: int = 12,
    background: int | None = None,
    travel_px: tuple[int, int] | None = None,
) -> None:
    """An mpeg4 clip (PyAV) of one shape moving in `direction` in a straight line from a random start over a noisy
    grey background: every frame alone shows a shape at a random place, only two frames show where it goes.

    The shape (side `shape_share` of the shorter side) travels at least half the free span of the frame; the start is
    drawn so that the whole path stays inside; the background is a random grey with pixel noise of +-`noise`, or,
    with `background` set, that flat grey level (0: black; no noise, and no grey is drawn from `rng`). On a fixed
    dark background every colour is brighter than the background, so the frame difference alone says where the
    shape arrives and where it leaves. `travel_px` (low, high): draw the travel from that range of pixels instead
    (short moves give less away through the start position). `width` and `height` must be even (yuv420p).
    """
    import av

    dx, dy = DIRECTIONS[direction]
    side = max(4, int(min(width, height) * shape_share + 1e-6))
    free = (width - side, height - side)
    span = free[0] if dx else free[1]
    low_travel, high_travel = travel_px if travel_px is not None else (span // 2, span)
    travel = int(rng.integers(low_travel, high_travel + 1))
    start = []
    for axis, d in enumerate((dx, dy)):
        low = travel if d < 0 else 0
        high = free[axis] - (travel if d > 0 else 0)
        start.append(int(rng.integers(low, high + 1)))
    if background is None:
        grey = int(rng.integers(70, 180))
        canvas = np.clip(grey + rng.integers(-noise, noise + 1, (height, width, 3)), 0, 255).astype(np.uint8)
    else:
        canvas = np.full((height, width, 3), background, dtype=np.uint8)
    fill = COLOURS[colour]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            step = round(travel * i / max(num_frames - 1, 1))
            x0, y0 = start[0] + dx * step, start[1] + dy * step
            image = Image.fromarray(canvas)
            draw = ImageDraw.Draw(image)
            box = (x0, y0, x0 + side - 1, y0 + side - 1)
            if shape == "circle":
                draw.ellipse(box, fill=fill)
            elif shape == "square":
                draw.rectangle(box, fill=fill)
            else:
                draw.polygon([(x0 + side / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")))
        container.mux(stream.encode())


def make_shapes_dataset(
    out_dir: str | Path, *, num_train: int, num_eval: int, image_size: int, seed: int, text_only_share: float = 0.0,
    pairs: bool = False,
) -> dict[str, Any]:
    """Write `images/*.png`, `train.jsonl`, `eval.jsonl` (mllm format) and `meta.json` into `out_dir`; returns the meta.

    `text_only_share` of the `num_train` training rows (rounded) are text-only questions
    (`TEXT_ONLY_OBJECTS`); the `num_eval` rows all have an image. Deterministic in its
    arguments. If `out_dir/meta.json` already exists nothing is written; it must record the
    same arguments (`DataError` otherwise).

    `pairs`: preference rows for DPO: the same rows (the same images and chosen answers), each with a `rejected`
    column that names a wrong colour (the same shape; for a text-only question another colour).
    """
    out_dir = Path(out_dir)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    meta = {
        "chance": 1 / len(classes),
        "num_classes": len(classes),
        "colours": list(COLOURS),
        "shapes": list(SHAPES),
        "prompt": PROMPT,
        "num_train": num_train,
        "num_eval": num_eval,
        "image_size": image_size,
        "seed": seed,
        "text_only_share": text_only_share,
        **({"pairs": True} if pairs else {}),
    }
    text_only = _text_only_rows(num_train, text_only_share, seed)
    existing = _existing_meta(out_dir, meta)
    if existing is not None:
        return existing
    meta["num_text_only_train"] = len(text_only)

    def write(tmp: Path) -> None:
        (tmp / "images").mkdir()
        rng = np.random.default_rng(seed)
        text_rng = np.random.default_rng([seed, 2])
        wrong_rng = np.random.default_rng([seed, 3])  # its own stream: the chosen rows equal the SFT rows
        objects = list(TEXT_ONLY_OBJECTS)
        for split, count, text_rows in (("train", num_train, text_only), ("eval", num_eval, set())):
            labels = iter(rng.permutation(np.arange(count - len(text_rows)) % len(classes)).tolist())
            with open(tmp / f"{split}.jsonl", "w") as f:
                for i in range(count):
                    if i in text_rows:
                        obj = objects[int(text_rng.integers(len(objects)))]
                        colour = TEXT_ONLY_OBJECTS[obj]
                        question, answer, images = f"What colour is {obj}?", colour, []
                        wrong = "{}"
                    else:
                        colour, shape = classes[next(labels)]
                        name = f"images/{split}_{i:06d}.png"
                        _draw(rng, colour, shape, image_size, image_size).save(tmp / name)
                        question, answer, images = PROMPT, f"a {colour} {shape}", [name]
                        wrong = f"a {{}} {shape}"
                    row: dict[str, Any] = {
                        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                        "images": images,
                    }
                    if pairs:
                        others = [c for c in COLOURS if c != colour]
                        row["rejected"] = wrong.format(others[int(wrong_rng.integers(len(others)))])
                    f.write(json.dumps(row) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _publish(out_dir, write)
    return json.loads((out_dir / "meta.json").read_text())


MOTION_PROMPT = "<video>Which way does the {colour} {shape} move?"
"""The video question of `make_motion_dataset`; the answer is one of `DIRECTIONS`."""


def make_motion_dataset(
    out_dir: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    frame_size: int = 64,
    num_frames: int = 8,
    fps: int = 8,
    image_share: float = 0.25,
    text_only_share: float = 0.15,
    shape_share: float = 1 / 3,
    noise: int = 12,
    background: int | None = None,
    clip_colours: tuple[str, ...] | None = None,
    travel_px: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A task only video can solve, in mllm format: `videos/*.mp4`, `images/*.png`, `train.jsonl`, `eval.jsonl`,
    `meta.json` (with `chance` 0.25); returns the meta.

    A video row is a clip (`write_moving_shape_clip`: `num_frames` square frames at `fps`) of one shape moving left,
    right, up or down from a random start, asked `MOTION_PROMPT` with its colour and shape -> the direction. Any one
    frame shows a shape at a random place, so only the change between frames answers it (chance 0.25). Of the
    training rows, `image_share` are the shapes image question (`PROMPT` -> "a red circle") and `text_only_share`
    the text question (`TEXT_ONLY_OBJECTS`), so micro-batches mix videos, images and text (`shape_share`, `noise`,
    `background`: the clip's shape size, background noise and fixed background level, `write_moving_shape_clip`;
    `clip_colours`: the colours a clip's shape is drawn in, default all of `COLOURS`; `travel_px`: the range of its
    travel in pixels, `write_moving_shape_clip`); the evaluation rows are
    all video rows, with directions balanced. Deterministic in its arguments; if `out_dir/meta.json` exists nothing
    is written (it must record the same arguments, `DataError` otherwise).
    """
    out_dir = Path(out_dir)
    meta = {
        "kind": "motion",
        "chance": 1 / len(DIRECTIONS),
        "num_train": num_train,
        "num_eval": num_eval,
        "seed": seed,
        "frame_size": frame_size,
        "num_frames": num_frames,
        "fps": fps,
        "image_share": image_share,
        "text_only_share": text_only_share,
        "shape_share": shape_share,
        "noise": noise,
        "background": background,
        "clip_colours": list(clip_colours) if clip_colours is not None else None,
        "travel_px": list(travel_px) if travel_px is not None else None,
    }
    existing = _existing_meta(out_dir, meta)
    if existing is not None:
        return existing
    if not 0 <= image_share + text_only_share < 1:
        raise ValueError(f"image_share + text_only_share must be in [0, 1), got {image_share + text_only_share}")
    objects, directions = list(TEXT_ONLY_OBJECTS), list(DIRECTIONS)

    def row(rng: np.random.Generator, tmp: Path, split: str, i: int, kind: str, direction: str) -> dict[str, Any]:
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        videos: list[str] = []
        images: list[str] = []
        if kind == "text":
            obj = objects[int(rng.integers(len(objects)))]
            question, answer = f"What colour is {obj}?", TEXT_ONLY_OBJECTS[obj]
        elif kind == "image":
            images.append(f"images/{split}_{i:06d}.png")
            _draw(rng, colour, shape, frame_size, frame_size).save(tmp / images[0])
            question, answer = PROMPT, f"a {colour} {shape}"
        else:
            if clip_colours is not None:
                colour = str(rng.choice(list(clip_colours)))
            videos.append(f"videos/{split}_{i:06d}.mp4")
            write_moving_shape_clip(
                tmp / videos[0], rng, colour=colour, shape=shape, direction=direction,
                width=frame_size, height=frame_size, num_frames=num_frames, fps=fps,
                shape_share=shape_share, noise=noise, background=background, travel_px=travel_px,
            )
            question, answer = MOTION_PROMPT.format(colour=colour, shape=shape), direction
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": messages, "images": images, "videos": videos}

    def write(tmp: Path) -> None:
        (tmp / "images").mkdir()
        (tmp / "videos").mkdir()
        rng = np.random.default_rng(seed)
        for split, count in (("train", num_train), ("eval", num_eval)):
            shares = (image_share, text_only_share) if split == "train" else (0.0, 0.0)
            num_images, num_text = round(shares[0] * count), round(shares[1] * count)
            num_videos = count - num_images - num_text
            kinds = rng.permutation(["image"] * num_images + ["text"] * num_text + ["video"] * num_videos)
            turns = iter(rng.permutation(np.arange(count) % len(directions)).tolist())
            with open(tmp / f"{split}.jsonl", "w") as f:
                for i, kind in enumerate(kinds.tolist()):
                    f.write(json.dumps(row(rng, tmp, split, i, kind, directions[next(turns)])) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _publish(out_dir, write)
    return json.loads((out_dir / "meta.json").read_text())


VARLEN_IMAGE_SIZES = ((16, 16), (32, 48), (48, 32), (64, 64), (64, 16), (24, 40))
"""(width, height) of the variable-length dataset's images: 2 to 20 image tokens with 16-px patches after merging."""
VARLEN_QUESTIONS = (
    "What shape and colour is this?", "What colour is this?", "What shape is this?", "is this a red circle?",
)


def make_varlen_dataset(
    out_dir: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    image_sizes: tuple[tuple[int, int], ...] = VARLEN_IMAGE_SIZES,
    min_images: int = 0,
    max_images: int = 2,
    max_turns: int = 3,
    max_answer_words: int = 15,
    text_only_share: float = 0.0,
) -> dict[str, Any]:
    """A variable-length test set in mllm format (`images/*.png`, `train.jsonl`, `eval.jsonl`, `meta.json`); returns meta.

    Every row has `min_images` .. `max_images` images of sizes drawn from `image_sizes`,
    1 .. `max_turns` user/assistant turns (each image placeholder in a random user
    turn) and answers of 1 .. `max_answer_words` words, all from the tiny
    tokenizer's vocabulary — so samples differ in length, image count and image
    size, as real data does, while the shapes dataset's are all alike. Exactly
    round(`text_only_share` × rows) rows of each split have no image whatever
    `min_images` says (more may, when `min_images` is 0): text-only rows are supported in
    every layout (docs/data.md), and tests use the share to get mixed micro-batches
    deterministically. Deterministic in its arguments; if `out_dir/meta.json` exists
    nothing is written (it must record the same arguments, `DataError` otherwise).
    """
    out_dir = Path(out_dir)
    meta = {
        "kind": "varlen",
        "num_train": num_train,
        "num_eval": num_eval,
        "seed": seed,
        "image_sizes": [list(size) for size in image_sizes],
        "min_images": min_images,
        "max_images": max_images,
        "max_turns": max_turns,
        "max_answer_words": max_answer_words,
        "text_only_share": text_only_share,
    }
    text_only = {
        "train": _text_only_rows(num_train, text_only_share, seed),
        "eval": _text_only_rows(num_eval, text_only_share, seed + 1),
    }
    existing = _existing_meta(out_dir, meta)
    if existing is not None:
        return existing
    answer_words = ("a", "and", *COLOURS, *SHAPES)

    def row(rng: np.random.Generator, tmp: Path, name: str, text_only: bool) -> dict[str, Any]:
        num_turns = int(rng.integers(1, max_turns + 1))
        num_images = int(rng.integers(min_images, max_images + 1))
        image_turns = sorted(rng.integers(0, num_turns, 0 if text_only else num_images).tolist())
        images = []
        for i, _ in enumerate(image_turns):
            width, height = image_sizes[int(rng.integers(len(image_sizes)))]
            path = f"images/{name}_{i}.png"
            _draw(rng, str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)), width, height).save(tmp / path)
            images.append(path)
        messages = []
        for turn in range(num_turns):
            question = VARLEN_QUESTIONS[int(rng.integers(len(VARLEN_QUESTIONS)))]
            messages.append({"role": "user", "content": "<image>" * image_turns.count(turn) + question})
            words = rng.choice(answer_words, int(rng.integers(1, max_answer_words + 1)))
            messages.append({"role": "assistant", "content": " ".join(words.tolist())})
        return {"messages": messages, "images": images}

    def write(tmp: Path) -> None:
        (tmp / "images").mkdir()
        rng = np.random.default_rng(seed)
        for split, count in (("train", num_train), ("eval", num_eval)):
            with open(tmp / f"{split}.jsonl", "w") as f:
                for i in range(count):
                    f.write(json.dumps(row(rng, tmp, f"{split}_{i:06d}", i in text_only[split])) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _publish(out_dir, write)
    return json.loads((out_dir / "meta.json").read_text())


def prepare_synthetic(data_cfg: DataConfig, pairs: bool = False) -> None:
    """`synthetic_shapes`' preparation: the shapes data in `dataset_dir` and, where the processor directory does
    not exist, the image plugin's tiny processor there."""
    from mmfsdp.data.plugins import get_plugin
    from mmfsdp.data.templates import get_template

    syn = data_cfg.dataset_param.synthetic
    dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser()
    make_shapes_dataset(  # generates when missing; data generated with other settings is an error, never reused
        dataset_dir, num_train=syn.num_train, num_eval=syn.num_eval, image_size=syn.image_size, seed=syn.seed,
        text_only_share=syn.text_only_share, pairs=pairs,
    )
    model_dir = data_cfg.dataset_param.preprocess_parameters.model_name_or_path
    if model_dir and not Path(model_dir).expanduser().exists():
        pp = data_cfg.dataset_param.preprocess_parameters
        plugin = get_plugin(pp.image_plugin or get_template(pp.template).default_plugin)
        write = getattr(plugin, "write_tiny_processor", None)
        if write is None:
            raise ConfigError(
                "data.dataset_param.preprocess_parameters.model_name_or_path",
                f"{model_dir!r} does not exist, and image plugin {plugin.name!r} cannot write a tiny processor for "
                "the synthetic data; give an existing processor directory",
            )
        write(Path(model_dir).expanduser(), image_size=syn.image_size, patch_size=syn.patch_size, spatial_merge_size=syn.spatial_merge_size)


def synthetic_files(data_cfg: DataConfig, split: str) -> list[Path]:
    """`synthetic_shapes`' file of `split`: `dataset_dir/<split>.jsonl`."""
    dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser()
    path = dataset_dir / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path} does not exist; call mmfsdp.data.prepare_dataset(data_cfg) first to generate the synthetic_shapes data")
    return [path.resolve()]


def prepare_synthetic_pairs(data_cfg: DataConfig) -> None:
    """`synthetic_shapes_pairs`' preparation: preference rows (`attr.ranking` must be true)."""
    _check_ranking(data_cfg)
    prepare_synthetic(data_cfg, pairs=True)


def synthetic_pair_files(data_cfg: DataConfig, split: str) -> list[Path]:
    """`synthetic_shapes_pairs`' file of `split`."""
    _check_ranking(data_cfg)
    return synthetic_files(data_cfg, split)


def _check_ranking(data_cfg: DataConfig) -> None:
    if not data_cfg.dataset_param.attr.ranking:
        raise ConfigError(
            "data.dataset_param.attr.ranking", "must be true for dataset_type synthetic_shapes_pairs (it writes preference rows)"
        )
