"""`mm-data stats` and `inspect` report audio: seconds and tokens per sample, each clip's decoding and tokens, audio
blocks in the decoded text, the audio settings with their sources."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmfsdp.data.cli import main


@pytest.fixture()
def config_file(tmp_path, omni_dir, h):
    rng = np.random.default_rng(0)
    h.write_audio(tmp_path / "one.wav", rng.uniform(-0.3, 0.3, (2, 44100)), 44100)  # 1 s, stereo
    h.write_audio(tmp_path / "half.flac", rng.uniform(-0.3, 0.3, (1, 8000)), 16000, "flac")  # 0.5 s
    h.write_image(tmp_path / "img.png", 64, 64)

    def row(question, images=(), audios=()):
        return {
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "yes"}],
            "images": list(images), "audios": list(audios),
        }

    h.write_jsonl(tmp_path / "d.jsonl", [
        row("Hello"),
        row("<audio>Is it loud?", audios=["half.flac"]),
        row("<audio><image>Same?", ["img.png"], ["one.wav"]),
        row("<audio> or <audio>?", audios=["one.wav", "half.flac"]),
    ])
    preprocess = {"model_name_or_path": str(omni_dir), "template": "qwen3_omni_nothink"}
    return h.write_run_yaml(tmp_path, preprocess, {"audios": "audios"})


@pytest.mark.timeout(300)
def test_stats_and_inspect_report_audio(config_file, capsys):
    # 1 s: 100 frames -> 13 tokens; 0.5 s: 50 frames -> 7 tokens (alone or beside the 1 s clip: 8000 samples, no
    # partial hop); every block adds <|audio_start|> and <|audio_end|>
    assert main(["stats", str(config_file), "--top", "2", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["with_audio"] == 3 and stats["with_images"] == 1
    assert stats["audio_tokens"] == {"min": 0, "mean": 12.0, "p50": 9, "p90": 24, "p99": 24, "max": 24}
    assert stats["audio_seconds"] == {"min": 0.0, "mean": 0.75, "p50": 0.5, "p90": 1.5, "p99": 1.5, "max": 1.5}
    assert [w["row"] for w in stats["worst"]] == [3, 2]  # 24 audio tokens, then 15 and the image's 6
    assert stats["worst"][0]["audios"] == 2 and stats["worst"][0]["audio_seconds"] == 1.5
    assert stats["worst"][1]["audio_tokens"] == 15 and stats["worst"][1]["vision_tokens"] == 6
    assert main(["stats", str(config_file), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 samples (train): 1 with images, 0 with videos, 3 with audio" in out
    assert "audio tokens per sample:  min 0, mean 12," in out and "audio seconds per sample: min 0, mean 0.75" in out
    assert "most vision and audio tokens (top 2)" in out and "2 audios: 24 (1.5 s)" in out

    assert main(["inspect", str(config_file), "--index", "3"]) == 0
    out = capsys.readouterr().out
    assert "audio 0: " in out and "one.wav: 1.00 s (44100 Hz, 2 channels -> 16000 samples at 16000 Hz mono) -> " \
        "100 frames -> 13 <|audio_pad|>, 15 tokens with start/end" in out
    assert "<audio 1.0s 13> or <audio 0.5s 7>?" in out
    assert "audio_max_seconds" in out and "feature_extractor.sampling_rate" in out
    assert "16000 (model directory: preprocessor_config.json)" in out
    assert main(["inspect", str(config_file), "--index", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["audio_grids"] == [[8000, 50, 7, 16000, 1]] and record["audio_seconds"] == [0.5]
    assert record["media_settings"]["audio_timeout"] == {"value": 60.0, "source": "default"}
