"""Mixed test data as real SFT mixes are: rows with several images of different sizes and text-only rows.

`make_mixed_dataset` writes `make_varlen_dataset`'s rows (1–2 images of varied sizes, 1–3 turns, answers
of varied length) and turns every `text_only_every`-th row into a text-only row (its `<image>` placeholders
and `images` removed), so the share of text-only rows is exact and the same for train and eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmfsdp.data.synthetic import COLOURS, DIRECTIONS, SHAPES, make_varlen_dataset, write_moving_shape_clip

CLIP_SIZES = ((32, 32), (64, 32), (48, 64), (64, 64))
"""(width, height) of the clips: 1 to 4 merged tokens per temporal group with 16-px patches and merge 2."""


def make_mixed_dataset(
    out_dir: Path, *, num_train: int, num_eval: int, seed: int, text_only_every: int = 2, **varlen
) -> Path:
    """The dataset directory (`train.jsonl`, `eval.jsonl`, `images/`); rows with `index % text_only_every == 1`
    (and every row when `text_only_every` is 1) have no image. `varlen`: more `make_varlen_dataset` arguments."""
    make_varlen_dataset(
        out_dir, num_train=num_train, num_eval=num_eval, seed=seed, min_images=1, max_images=2, **varlen
    )
    for split in ("train", "eval"):
        path = out_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for index, row in enumerate(rows):
            if text_only_every == 1 or index % text_only_every == 1:
                row["images"] = []
                for message in row["messages"]:
                    message["content"] = message["content"].replace("<image>", "")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_dir


def make_mixed_video_dataset(out_dir: Path, *, num_train: int, num_eval: int, seed: int) -> Path:
    """`make_varlen_dataset`'s rows (1–2 images of varied sizes, 1–3 turns) made into a video mix, by row index:
    `% 3 == 0` a video row (one clip of 4–12 frames at 4–8 fps and one of `CLIP_SIZES` in a random user turn; every
    other one keeps its first image, so a sample holds a video and an image), `% 3 == 1` text-only, `% 3 == 2` as
    written (images only). Clips are written with PyAV under `videos/`; the rows name them in a `videos` column."""
    make_varlen_dataset(out_dir, num_train=num_train, num_eval=num_eval, seed=seed, min_images=1, max_images=2)
    if (out_dir / "videos").is_dir():
        return out_dir
    rng = np.random.default_rng(seed)
    for split in ("train", "eval"):
        path = out_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for index, row in enumerate(rows):
            row["videos"] = []
            if index % 3 == 2:
                continue
            keep = 1 if index % 6 == 0 else 0
            images, row["images"] = row["images"], row["images"][:keep]
            seen = 0
            for message in row["messages"]:
                parts = message["content"].split("<image>")
                text = parts[0]
                for part in parts[1:]:
                    text += ("<image>" if seen < keep else "") + part
                    seen += 1
                message["content"] = text
            assert seen == len(images)
            if index % 3 == 1:
                continue
            name = f"videos/{split}_{index:04d}.mp4"
            width, height = CLIP_SIZES[int(rng.integers(len(CLIP_SIZES)))]
            write_moving_shape_clip(
                out_dir / name, rng, colour=str(rng.choice(list(COLOURS))), shape=str(rng.choice(SHAPES)),
                direction=str(rng.choice(list(DIRECTIONS))), width=width, height=height,
                num_frames=int(rng.integers(4, 13)), fps=int(rng.integers(4, 9)),
            )
            users = [m for m in row["messages"] if m["role"] == "user"]
            turn = users[int(rng.integers(len(users)))]
            turn["content"] = "<video>" + turn["content"]
            row["videos"] = [name]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_dir


def row_media(dataset_dir: Path, split: str = "train") -> list[tuple[int, int]]:
    """(number of videos, number of images) of each row."""
    rows = [json.loads(line) for line in (dataset_dir / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    return [(len(row.get("videos") or []), len(row.get("images") or [])) for row in rows]


def text_only_share(dataset_dir: Path, split: str = "train") -> float:
    rows = [json.loads(line) for line in (dataset_dir / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    return sum(not row.get("images") for row in rows) / len(rows)


def make_mixed_pairs_dataset(out_dir: Path, *, num_train: int, num_eval: int, seed: int) -> Path:
    """`make_mixed_dataset`'s rows (every other row text-only; 1–2 images of varied sizes, 1–3 turns) as preference
    pairs in the messages format: the last assistant turn is `chosen`, and `rejected` is another row's last answer
    cut or extended to a different length (never equal to chosen). Rows are written as `{"messages", "rejected",
    "images"}` (the mllm messages format with a `rejected` answer)."""
    make_mixed_dataset(out_dir, num_train=num_train, num_eval=num_eval, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for split in ("train", "eval"):
        path = out_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        answers = [row["messages"][-1]["content"] for row in rows]
        for index, row in enumerate(rows):
            assert row["messages"][-1]["role"] == "assistant"
            other = answers[(index + 1 + int(rng.integers(len(rows) - 1))) % len(rows)]
            words = other.split()
            keep = max(1, int(rng.integers(1, len(words) + 1)))
            rejected = " ".join(words[:keep] + (["again"] * int(rng.integers(0, 4))))
            if rejected == row["messages"][-1]["content"]:
                rejected += " no"
            row["rejected"] = rejected
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_dir


def make_mixed_audio_dataset(out_dir: Path, *, num_train: int, num_eval: int, seed: int) -> Path:
    """`make_beeps_dataset`'s rows (clips of 0.4-1.6 s, so 40-160 mel frames: one or two audio chunks; 25% shapes
    image rows, 30% text-only rows) with more media in some clip rows, by index among the clip rows of a split:
    `% 4 == 0` a second clip (the next clip row's, of another length) before the question, `% 4 == 1` an image (an
    image row's) before the clip, `% 4 == 2`, `% 8 == 3` the clip as the audio track of a video (`video_with_track`:
    read with `use_audio_in_video`). Text-only rows and image-only rows stay as written."""
    from mmfsdp.data.synthetic_audio import make_beeps_dataset

    make_beeps_dataset(out_dir, num_train=num_train, num_eval=num_eval, seed=seed, seconds=(0.4, 1.6),
                       image_share=0.25, text_only_share=0.3)
    if (out_dir / "mixed_audio.done").is_file():
        return out_dir
    images = sorted(str(path.relative_to(out_dir)) for path in (out_dir / "images").glob("*.png"))
    for split in ("train", "eval"):
        path = out_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        clip_rows = [row for row in rows if row["audios"]]
        for index, row in enumerate(clip_rows):
            user = row["messages"][0]
            if index % 4 == 0 and len(clip_rows) > 1:
                row["audios"].append(clip_rows[(index + 1) % len(clip_rows)]["audios"][0])
                user["content"] = "<audio>" + user["content"]
            elif index % 4 == 1 and images:
                row["images"] = [images[index % len(images)]]
                user["content"] = "<image>" + user["content"]
            elif index % 4 >= 2 and index % 8 != 7:
                name = f"videos/{split}_{index:04d}.mkv"
                video_with_track(out_dir / name, out_dir / row["audios"][0], np.random.default_rng(index))
                row["videos"], row["audios"] = [name], []
                user["content"] = user["content"].replace("<audio>", "<video>")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out_dir / "mixed_audio.done").touch()
    return out_dir


def video_with_track(path: Path, clip: Path, rng: np.random.Generator, *, size: tuple[int, int] = (48, 32)) -> None:
    """A Matroska video (mpeg4 at 4 fps, a bright square moving right over noise, as long as the clip) whose audio
    track is the WAV `clip`'s samples (16-bit PCM)."""
    import av

    with av.open(str(clip)) as source:
        stream = source.streams.audio[0]
        rate, layout = stream.rate, stream.layout.name
        pcm = np.concatenate([frame.to_ndarray() for frame in source.decode(stream)], axis=1)
    width, height = size
    frames = max(2, int(np.ceil(pcm.shape[1] / rate * 4)))
    path.parent.mkdir(parents=True, exist_ok=True)
    background = rng.integers(0, 96, (height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=4)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = out.add_stream("pcm_s16le", rate=rate, layout=layout)
        for i in range(frames):
            frame = background.copy()
            x = i * (width - 8) // max(1, frames - 1)
            frame[height // 3 : height // 3 + 8, x : x + 8] = 255
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        for start in range(0, pcm.shape[1], 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start : start + 1024]), format="s16", layout=layout)
            chunk.sample_rate, chunk.pts = rate, start
            out.mux(audio.encode(chunk))
        out.mux(audio.encode(None))
