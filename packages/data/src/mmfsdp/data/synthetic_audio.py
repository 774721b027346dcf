"""Synthetic data that only the audio path can answer: beeps to count and a pitch to tell, beside images and text.

`make_beeps_dataset` writes short WAV clips (16 kHz, mono, 16-bit) of one, two or three beeps, all low (a pitch
drawn in 300-500 Hz) or all high (1.5-2.5 kHz), at random times, loudness and length over faint noise, and asks
"`<audio>What do you hear?`" -> "`two high beeps`" (6 answers, chance 1/6). Nothing of the answer is in the text of
the prompt, so a model reaches more than chance only through the audio encoder. The training rows mix the clips with
the shapes image question ("What shape and colour is this?" -> "a red circle", `image_share`) and text-only
questions ("What colour is a banana?" -> "yellow", `text_only_share`), so micro-batches hold audio, image and
text-only rows side by side; the held-out rows are all clips, their answers balanced.

Written into a temporary sibling and renamed into place (`mmfsdp.data.synthetic`'s rule): several ranks may call it
at once; data already there is reused when it was made with the same settings, refused otherwise.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmfsdp.config import ConfigError
from mmfsdp.data.synthetic import COLOURS, PROMPT, SHAPES, TEXT_ONLY_OBJECTS, _draw, _existing_meta, _publish

if TYPE_CHECKING:
    from mmfsdp.data.config import DataConfig

__all__ = [
    "BEEP_COUNTS", "BEEP_PITCHES", "BEEPS_PROMPT", "beeps_answer", "make_beeps_dataset", "prepare_beeps", "write_beeps_clip",
]

BEEPS_PROMPT = "<audio>What do you hear?"
"""The audio question; the answer is `beeps_answer(count, pitch)`."""
BEEP_COUNTS = {1: "one", 2: "two", 3: "three"}
BEEP_PITCHES = {"low": (300.0, 500.0), "high": (1500.0, 2500.0)}
"""Pitch name -> the range its tone's frequency is drawn from, in Hz."""
RATE = 16000
"""Sample rate of the clips: Qwen3-Omni's feature extractor's, so nothing is resampled."""


def beeps_answer(count: int, pitch: str) -> str:
    """`"one low beep"`, `"three high beeps"`."""
    return f"{BEEP_COUNTS[count]} {pitch} beep{'s' * (count > 1)}"


def write_beeps_clip(path: Path, rng: np.random.Generator, *, count: int, pitch: str, seconds: float) -> None:
    """A mono 16-bit WAV of `seconds` at 16 kHz: `count` beeps of one frequency drawn from `BEEP_PITCHES[pitch]`,
    each 80-160 ms with 10 ms fades and its own loudness (0.2-0.6), in disjoint random slots, over noise at 0.01."""
    n = int(seconds * RATE)
    signal = rng.normal(0.0, 0.01, n)
    frequency = rng.uniform(*BEEP_PITCHES[pitch])
    slot = n // count
    fade = int(0.01 * RATE)
    for k in range(count):
        length = int(rng.uniform(0.08, 0.16) * RATE)
        start = k * slot + int(rng.integers(0, max(1, slot - length)))
        envelope = np.minimum(1.0, np.minimum(np.arange(length) + 1, length - np.arange(length)) / fade)
        t = np.arange(length) / RATE
        signal[start:start + length] += rng.uniform(0.2, 0.6) * envelope * np.sin(2 * np.pi * frequency * t)
    pcm = np.round(np.clip(signal, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(pcm.tobytes())


def make_beeps_dataset(
    out_dir: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    seconds: tuple[float, float] = (0.8, 1.2),
    image_share: float = 0.1,
    text_only_share: float = 0.1,
    image_size: int = 32,
) -> dict[str, Any]:
    """The beeps task in mllm format (module docstring): `audios/*.wav`, `images/*.png`, `train.jsonl`,
    `eval.jsonl`, `meta.json` (with `chance` 1/6); returns the meta. A clip lasts a length drawn from `seconds`;
    `image_size` is the side of the shapes images. Deterministic in its arguments; if `out_dir/meta.json` exists
    nothing is written (it must record the same arguments, `DataError` otherwise)."""
    out_dir = Path(out_dir)
    answers = [(count, pitch) for count in BEEP_COUNTS for pitch in BEEP_PITCHES]
    meta = {
        "kind": "beeps", "chance": 1 / len(answers), "num_train": num_train, "num_eval": num_eval, "seed": seed,
        "seconds": list(seconds), "image_share": image_share, "text_only_share": text_only_share,
        "image_size": image_size,
    }
    existing = _existing_meta(out_dir, meta)
    if existing is not None:
        return existing
    if not 0 <= image_share + text_only_share < 1:
        raise ValueError(f"image_share + text_only_share must be in [0, 1), got {image_share + text_only_share}")
    objects = list(TEXT_ONLY_OBJECTS)

    def row(rng: np.random.Generator, tmp: Path, split: str, i: int, kind: str, answer: int) -> dict[str, Any]:
        audios: list[str] = []
        images: list[str] = []
        if kind == "text":
            obj = objects[int(rng.integers(len(objects)))]
            question, reply = f"What colour is {obj}?", TEXT_ONLY_OBJECTS[obj]
        elif kind == "image":
            colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
            images.append(f"images/{split}_{i:06d}.png")
            _draw(rng, colour, shape, image_size, image_size).save(tmp / images[0])
            question, reply = PROMPT, f"a {colour} {shape}"
        else:
            count, pitch = answers[answer]
            audios.append(f"audios/{split}_{i:06d}.wav")
            write_beeps_clip(tmp / audios[0], rng, count=count, pitch=pitch, seconds=float(rng.uniform(*seconds)))
            question, reply = BEEPS_PROMPT, beeps_answer(count, pitch)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        return {"messages": messages, "images": images, "audios": audios}

    def write(tmp: Path) -> None:
        (tmp / "images").mkdir()
        (tmp / "audios").mkdir()
        rng = np.random.default_rng(seed)
        for split, count in (("train", num_train), ("eval", num_eval)):
            shares = (image_share, text_only_share) if split == "train" else (0.0, 0.0)
            num_images, num_text = round(shares[0] * count), round(shares[1] * count)
            kinds = rng.permutation(["image"] * num_images + ["text"] * num_text + ["audio"] * (count - num_images - num_text))
            balanced = iter(rng.permutation(np.arange(count) % len(answers)).tolist())
            with open(tmp / f"{split}.jsonl", "w") as f:
                for i, kind in enumerate(kinds.tolist()):
                    f.write(json.dumps(row(rng, tmp, split, i, kind, next(balanced))) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))

    _publish(out_dir, write)
    return json.loads((out_dir / "meta.json").read_text())


def prepare_beeps(data_cfg: DataConfig) -> None:
    """`dataset_type: synthetic_beeps`: the beeps data in `basic_parameters.dataset_dir` from the `synthetic`
    section (`num_train`, `num_eval`, `seed`, `image_share`, `text_only_share`, `image_size`); its splits are
    `train.jsonl` and `eval.jsonl` there, its clips read through `attr.audios: audios`."""
    param = data_cfg.dataset_param
    if param.attr.audios != "audios":
        raise ConfigError("data.dataset_param.attr.audios", "must be 'audios' for dataset_type synthetic_beeps (its rows' clips)")
    syn = param.synthetic
    make_beeps_dataset(
        Path(param.basic_parameters.dataset_dir).expanduser(), num_train=syn.num_train, num_eval=syn.num_eval,
        seed=syn.seed, image_share=syn.image_share, text_only_share=syn.text_only_share, image_size=syn.image_size,
    )

