"""Bad video input is a counted bad row with its reason (strict: file, row and reason), never a crash or a hang.

Each case is bounded by a pytest timeout: corrupt and truncated files, a stream with no
decodable frame, a file with no video stream, absurd size or duration, a path escaping
`dataset_dir` (nothing is opened), a decode past `video_timeout`, a missing file, and a
video row for a family without video (pixtral).
"""

from __future__ import annotations

import dataclasses
import json

import av
import pytest

from mmfsdp.data import BadSample, DataError, SampleEncoder, build_dataset
from mmfsdp.data import video as video_module
from mmfsdp.data.video import decode_frames, read_video_info


def _row(videos, text="<video>What moves?"):
    return {
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "A square."}],
        "videos": videos,
    }


@pytest.fixture
def encoder(qwen_processor, h, tmp_path):
    cfg = h.data_config(
        qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"}, attr={"videos": "videos"}
    )
    return SampleEncoder(cfg, qwen_processor)


@pytest.mark.timeout(60)
def test_corrupt_and_missing_files(encoder, tmp_path, h):
    (tmp_path / "noise.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    assert h.bad_reason(encoder, _row(["noise.mp4"])) == "corrupt_video"
    assert h.bad_reason(encoder, _row(["absent.mp4"])) == "missing_video"


@pytest.mark.timeout(60)
def test_truncated_file(encoder, tmp_path, h):
    """Matroska keeps its duration in the front header: a cut file still announces 12 frames, and the worker finds
    only the first ones (cut at 90 %) or none (cut inside the first, key, frame)."""
    data = open(h.write_video(tmp_path / "whole.mkv", 12, 48, 32), "rb").read()
    cuts = (("cut.mkv", 9 / 10, "only 6 decodable frames"), ("stub.mkv", 1 / 3, "no decodable frames"))
    for name, keep, found in cuts:
        (tmp_path / name).write_bytes(data[: int(len(data) * keep)])
        sample = encoder.encode_row(_row([name]))
        assert sample["video_grids"][0][9:] == [0, 4, 7, 11]  # sampled from the header's 12 frames at 8 fps
        with pytest.raises(BadSample, match=found) as bad:
            encoder.plugin.video_inputs(sample["videos"], [tuple(g) for g in sample["video_grids"]])
        assert bad.value.reason == "corrupt_video"
    (tmp_path / "cut.avi").write_bytes(open(h.write_video(tmp_path / "whole.avi", 12, 48, 32), "rb").read()[:2000])
    assert h.bad_reason(encoder, _row(["cut.avi"])) == "corrupt_video"  # AVI: the damage already shows in the header


def _reason_anywhere(encoder, row) -> str:
    """The reason a row fails for, while tokenizing (headers) or while its frames are decoded."""
    try:
        sample = encoder.encode_row(row)
        encoder.plugin.video_inputs(sample["videos"], [tuple(g) for g in sample["video_grids"]])
    except BadSample as bad:
        return bad.reason
    raise AssertionError("the row was not refused")


@pytest.mark.timeout(60)
def test_no_decodable_frames_and_no_video_stream(encoder, tmp_path, h):
    data = bytearray(open(h.write_video(tmp_path / "whole.avi", 12, 48, 32), "rb").read())
    movi = data.index(b"movi") + 4
    data[movi : len(data) - 512] = bytes(len(data) - 512 - movi)  # headers kept, every frame's data zeroed
    (tmp_path / "blank.avi").write_bytes(bytes(data))
    assert _reason_anywhere(encoder, _row(["blank.avi"])) == "corrupt_video"
    with av.open(str(tmp_path / "audio.mkv"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame(format="s16", layout="mono", samples=800)
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    assert h.bad_reason(encoder, _row(["audio.mkv"])) == "unsupported_video"


@pytest.mark.timeout(60)
def test_absurd_size_and_duration(encoder, tmp_path, h, monkeypatch):
    h.write_video(tmp_path / "clip.mp4", 8, 48, 32)
    monkeypatch.setattr(video_module, "MAX_VIDEO_FRAME_PIXELS", 48 * 32 - 1)
    with pytest.raises(BadSample, match="48x32; frames must have between 1 and 1535 pixels") as bad:
        encoder.encode_row(_row(["clip.mp4"]))
    assert bad.value.reason == "unsupported_video"
    monkeypatch.undo()
    monkeypatch.setattr(video_module, "MAX_VIDEO_DURATION_S", 0.5)
    assert h.bad_reason(encoder, _row(["clip.mp4"])) == "unsupported_video"


@pytest.mark.timeout(60)
def test_too_few_frames_for_a_temporal_patch(encoder, tmp_path, h):
    h.write_video(tmp_path / "one.mp4", 1, 48, 32)
    assert h.bad_reason(encoder, _row(["one.mp4"])) == "unsupported_video"


@pytest.mark.timeout(60)
def test_a_path_escaping_dataset_dir_is_never_opened(encoder, tmp_path, monkeypatch, h):
    opened = []
    monkeypatch.setattr(av, "open", lambda *a, **k: opened.append(a) or pytest.fail("a refused video was opened"))
    assert h.bad_reason(encoder, _row(["../outside.mp4"])) == "video_outside_dataset_dir"
    assert h.bad_reason(encoder, _row(["clips/../../outside.mp4"])) == "video_outside_dataset_dir"
    assert opened == []


@pytest.mark.timeout(60)
def test_placeholder_mismatch_and_wrong_turn(encoder, tmp_path, h):
    assert h.bad_reason(encoder, _row(["a.mp4", "b.mp4"])) == "video_count_mismatch"
    assert h.bad_reason(encoder, _row([], text="What moves? <video>")) == "video_count_mismatch"
    row = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<video>"}],
        "videos": ["a.mp4"],
    }
    assert h.bad_reason(encoder, row) == "video_in_wrong_turn"


@pytest.mark.timeout(60)
def test_decoding_is_bounded_in_time(tmp_path, h):
    path = h.write_video(tmp_path / "clip.mp4", 16, 48, 32)
    assert read_video_info(path).num_frames == 16
    assert decode_frames(path, [0, 15], timeout_s=30).shape == (2, 32, 48, 3)
    for timeout_s in (1e-9, 1e-4):  # fires in FFmpeg's open/read callback or in the per-packet check
        with pytest.raises(BadSample, match="took over") as bad:
            decode_frames(path, [0, 15], timeout_s=timeout_s)
        assert bad.value.reason == "video_timeout"


@pytest.mark.timeout(120)
def test_bad_video_rows_are_counted_and_strict_names_file_row_and_reason(qwen_processor, h, tmp_path):
    h.write_video(tmp_path / "good.mp4", 12, 48, 32)
    (tmp_path / "noise.mp4").write_bytes(b"not a video at all" * 64)
    rows = [_row(["good.mp4"]), _row(["noise.mp4"]), _row(["../x.mp4"]), _row(["absent.mp4"])]
    train = h.write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = h.data_config(
        qwen_processor.name_or_path,
        tmp_path,
        preprocess={"template": "qwen3_vl_nothink"},
        attr={"videos": "videos"},
        basic={"dataset": str(train)},
    )
    dataset = build_dataset(cfg, qwen_processor)
    assert len(dataset) == 1
    assert dataset.bad_row_counts == {"video_outside_dataset_dir": 1, "missing_video": 1, "corrupt_video": 1}
    assert "pixel_values_videos" in dataset[0]
    # a decode past video_timeout in a worker: the item says so (the loader skips and counts it) instead of hanging
    plugin = dataset.encoder.plugin
    plugin.video_options = dataclasses.replace(plugin.video_options, timeout_s=1e-9)
    assert dataset[0]["bad_reason"] == "video_timeout"
    strict = h.data_config(
        qwen_processor.name_or_path,
        tmp_path,
        preprocess={"template": "qwen3_vl_nothink"},
        attr={"videos": "videos"},
        basic={"dataset": str(train), "strict": True, "cache_dir": str(tmp_path / "strict")},
    )
    with pytest.raises(DataError, match=r"train\.jsonl row 1: corrupt_video: .*noise\.mp4"):
        build_dataset(strict, qwen_processor)


@pytest.mark.timeout(60)
def test_a_family_without_video_counts_a_video_row(tekken_processor, h, tmp_path):
    h.write_video(tmp_path / "good.mp4", 8, 48, 32)
    rows = [
        _row(["good.mp4"]),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    ]
    train = h.write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = h.data_config(
        tekken_processor.name_or_path,
        tmp_path,
        preprocess={"template": "mistral"},
        attr={"videos": "videos"},
        basic={"dataset": str(train)},
    )
    dataset = build_dataset(cfg, tekken_processor)
    assert len(dataset) == 1 and dataset.bad_row_counts == {"video_not_supported": 1}
    assert json.loads(json.dumps(dataset.bad_row_counts))  # plain, printable counts
