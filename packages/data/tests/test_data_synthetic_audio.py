"""The beeps task (`mmfsdp.data.synthetic_audio`): each clip holds what its answer says (the beeps counted from the
clip's loudness, the pitch from its spectrum), the held-out answers are balanced, the training rows mix audio, image
and text-only rows in the asked shares, the generator is deterministic and refuses other settings, and the rows
encode with Qwen3-Omni's plugin."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest

from mmfsdp.data import DataError, SampleEncoder
from mmfsdp.data.synthetic_audio import BEEP_COUNTS, BEEPS_PROMPT, beeps_answer, make_beeps_dataset


def _read(path) -> np.ndarray:
    with wave.open(str(path)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (16000, 1, 2)
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2") / 32768


def _heard(samples: np.ndarray) -> str:
    """The answer a listener gives: beeps = runs of 10 ms windows louder than 0.05 RMS; high = the spectrum's peak
    over 1 kHz."""
    windows = samples[: len(samples) // 160 * 160].reshape(-1, 160)
    loud = np.sqrt((windows**2).mean(axis=1)) > 0.05
    count = int(loud[0]) + int(np.count_nonzero(loud[1:] & ~loud[:-1]))
    peak = np.argmax(np.abs(np.fft.rfft(samples))) * 16000 / len(samples)
    return beeps_answer(count, "high" if peak > 1000 else "low")


@pytest.fixture(scope="module")
def beeps(tmp_path_factory):
    out = tmp_path_factory.mktemp("beeps") / "data"
    return out, make_beeps_dataset(out, num_train=60, num_eval=24, seed=3)


def test_clips_hold_their_answers_and_splits_mix(beeps):
    out, meta = beeps
    assert meta["chance"] == pytest.approx(1 / 6)
    splits = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "eval")}
    assert [len(splits["train"]), len(splits["eval"])] == [60, 24]
    audio_rows = [r for rows in splits.values() for r in rows if r["audios"]]
    for row in audio_rows:
        assert row["messages"][0]["content"] == BEEPS_PROMPT
        assert _heard(_read(out / row["audios"][0])) == row["messages"][1]["content"]
    kinds = [("audio" if r["audios"] else "image" if r["images"] else "text") for r in splits["train"]]
    assert (kinds.count("image"), kinds.count("text"), kinds.count("audio")) == (6, 6, 48)
    answers = [r["messages"][1]["content"] for r in splits["eval"]]
    assert all(r["audios"] for r in splits["eval"]) and all(answers.count(a) == 4 for a in set(answers))
    assert len(set(answers)) == 2 * len(BEEP_COUNTS)


def test_deterministic_and_refuses_other_settings(beeps, tmp_path):
    out, meta = beeps
    again = tmp_path / "again"
    make_beeps_dataset(again, num_train=60, num_eval=24, seed=3)
    for name in ("train.jsonl", "eval.jsonl", "audios/eval_000003.wav"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    assert make_beeps_dataset(out, num_train=60, num_eval=24, seed=3) == meta
    with pytest.raises(DataError, match="other settings.*seed: 3 there, 4 asked"):
        make_beeps_dataset(out, num_train=60, num_eval=24, seed=4)


def test_rows_encode_with_the_omni_plugin(beeps, omni_processor, h):
    out, _ = beeps
    cfg = h.data_config(omni_processor.name_or_path, out, preprocess={"template": "qwen3_omni_nothink"},
                        attr={"audios": "audios"})
    encoder = SampleEncoder(cfg, omni_processor)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()][:12]
    for row in rows:
        sample = encoder.encode_row(row)
        assert len(sample["audio_grids"]) == len(row["audios"]) and len(sample["image_grids"]) == len(row["images"])
        if row["audios"]:
            samples, frames, tokens = sample["audio_grids"][0][:3]
            assert samples == len(_read(out / row["audios"][0])) and frames == samples // 160
            assert 10 <= tokens <= 16  # Qwen3-Omni's encoder: 13 tokens a second, the clips 0.8-1.2 s
