"""`mm-data stats`: vision tokens per sample over a dataset (images and videos), the worst rows by source and row."""

from __future__ import annotations

import json

import pytest

from mmfsdp.data.cli import main, vision_token_stats


@pytest.fixture()
def config_file(tmp_path, qwen_dir, h):
    h.write_image(tmp_path / "small.png", 32, 32)
    h.write_image(tmp_path / "big.png", 96, 64)
    h.write_video(tmp_path / "short.mp4", 4, 32, 32, fps=4)
    h.write_video(tmp_path / "long.mp4", 12, 64, 64, fps=4, seed=1)

    def row(question, images=(), videos=()):
        return {
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "yes"}],
            "images": list(images), "videos": list(videos),
        }

    rows = [
        row("Hello"),
        row("<image>Is it red?", ["small.png"]),
        row("<video><image>Same?", ["big.png"], ["long.mp4"]),
        row("<video>Does it move?", videos=["short.mp4"]),
        row("<image><image>Two?", ["big.png", "small.png"]),
    ]
    h.write_jsonl(tmp_path / "d.jsonl", rows)
    preprocess = {
        "model_name_or_path": str(qwen_dir), "template": "qwen3_vl_nothink", "image_plugin": "qwen2_vl",
        "cutoff_len": 4096, "video_fps": 4.0, "video_maxlen": 8,
    }
    return h.write_run_yaml(tmp_path, preprocess, {"videos": "videos"})


@pytest.mark.timeout(300)
def test_stats_count_each_block_and_rank_the_worst_rows(config_file, capsys, h):
    assert main(["stats", str(config_file), "--top", "2", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_samples"] == 5 and stats["with_images"] == 3 and stats["with_videos"] == 2

    # the counts are the plugin's own blocks of each record's grids
    from mmfsdp.data.cli import _dataset, _parse

    dataset = _dataset(_parse(["stats", str(config_file)]))
    plugin = dataset.encoder.plugin
    expected = []
    for i in range(len(dataset)):
        record = dataset.record(i)
        vision = [len(plugin.image_tokens(tuple(g))) for g in record["image_grids"]]
        vision += [len(plugin.video_tokens(tuple(g))) for g in record["video_grids"]]
        expected.append(sum(vision))
        ids = record["input_ids"]
        assert ids.count(plugin.image_id) + ids.count(plugin.video_id) <= sum(vision)
    assert expected[0] == 0 and expected[2] == max(expected), expected  # the long video + the big image
    assert stats["vision_tokens"]["max"] == max(expected) and stats["vision_tokens"]["min"] == 0
    assert stats["vision_tokens"]["mean"] == round(sum(expected) / 5, 2)
    worst = stats["worst"]
    assert [w["row"] for w in worst] == sorted(range(5), key=lambda r: (-expected[r], r))[:2]
    assert worst[0]["videos"] == 1 and worst[0]["images"] == 1 and worst[0]["video_tokens"] > 0
    assert worst[0]["source"].endswith("d.jsonl")
    assert vision_token_stats(dataset, 0)["worst"] == []

    assert main(["stats", str(config_file), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "5 samples (train): 3 with images, 2 with videos" in out
    assert f"max {max(expected)}" in out and "d.jsonl row 2" in out
    assert main(["stats", str(config_file), "--top", "-1"]) == 2
