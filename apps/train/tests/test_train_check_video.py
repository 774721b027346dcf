"""`--check` on video configs: the example `examples/qwen3vl-video-tiny` passes (its data generator on a few rows),
the memory plan prints the token budget of one video, and names one that could outgrow `cutoff_len`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmfsdp.train.cli import main
from mmfsdp.train.config import load_config
from mmfsdp.train.memory import video_token_budget

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "qwen3vl-video-tiny"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("video_make_assets", EXAMPLE / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("video-example") / "data"
    meta = module.main(out, num_train=10, num_eval=4)
    assert meta["chance"] == 0.25
    return out


def _args(data: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        str(EXAMPLE / "config.yaml"), "--check", "--nproc-per-node", "2",
        f"data.dataset_param.basic_parameters.dataset={data / 'train.jsonl'}",
        f"data.dataset_param.basic_parameters.eval_dataset={data / 'eval.jsonl'}",
        f"data.dataset_param.basic_parameters.dataset_dir={data}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
        f"training.output_dir={tmp_path / 'out'}",
        *extra,
    ]


def test_example_generator_writes_the_task(data):
    rows = {split: [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "eval")}
    assert all(row["videos"] and row["messages"][1]["content"] in ("left", "right", "up", "down")
               for row in rows["eval"])
    kinds = {("video" if row["videos"] else "image" if row["images"] else "text") for row in rows["train"]}
    assert kinds == {"video", "image", "text"}
    for row in rows["train"] + rows["eval"]:
        for path in row["videos"] + row["images"]:
            assert (data / path).is_file() and (data / path).stat().st_size > 0


def test_example_passes_check_with_its_video_budget(data, tmp_path, capsys):
    assert main(_args(data, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "check passed: 2 processes, model qwen3_vl" in out
    # video_maxlen 8 frames in 4 temporal patches of 32 x 32 px: 1 pad + at most 8 timestamp/start/end tokens each
    assert "video tokens      ~<= 36 per video (4 temporal patches of <= 1024 px per frame, video_maxlen 8)" in out
    assert "video budget:" not in out
    # the settings the data will use, with their sources: the example's assets have no video_preprocessor_config.json
    assert f"  {'video_fps':<36} 2.0 (config)" in out
    default = "transformers default (Qwen3VLVideoProcessor.min_frames)"
    assert f"  {'video_processor.min_frames':<36} 4 ({default})" in out
    size = "{'shortest_edge': 1024, 'longest_edge': 65536} (model directory: preprocessor_config.json)"
    assert f"  {'video_processor.size':<36} {size}" in out


def test_check_budgets_the_video_processors_max_frames_when_video_maxlen_is_null(data, tmp_path, capsys):
    assert main(_args(data, tmp_path, "data.dataset_param.preprocess_parameters.video_maxlen=null")) == 0
    out = capsys.readouterr().out
    assert f"  {'video_maxlen':<36} 768 (transformers default (Qwen3VLVideoProcessor.max_frames))" in out
    assert "video tokens      ~<= 3456 per video (384 temporal patches of <= 1024 px per frame, video_maxlen 768)" \
        in out


def test_check_names_a_video_that_can_outgrow_cutoff_len(data, tmp_path, capsys):
    assert main(_args(data, tmp_path, "data.dataset_param.preprocess_parameters.video_max_pixels=65536")) == 0
    out = capsys.readouterr().out
    assert "video budget: one video may take 288 tokens > cutoff_len 256" in out


def test_video_token_budget():
    cfg = load_config(EXAMPLE / "config.yaml", [])
    vision = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    model_config = SimpleNamespace(vision_config=vision)
    budget = video_token_budget(cfg, model_config)
    assert (budget.num_frames, budget.num_temporal_patches, budget.frame_pixels, budget.tokens) == (8, 4, 1024, 36)
    pp = cfg.data.dataset_param.preprocess_parameters
    pp.video_maxlen, pp.video_total_pixels = 7, 8 * 1024  # 7 frames -> 4 patches of 2; 1024 px per frame
    assert video_token_budget(cfg, model_config).tokens == 4 * (1 + 8)
    pp.video_max_pixels = pp.video_total_pixels = None
    assert video_token_budget(cfg, model_config).tokens is None
    pp.video_maxlen = None  # null: --check passes the video processor's max_frames
    assert video_token_budget(cfg, model_config, max_frames=768).num_temporal_patches == 384
    cfg.data.dataset_param.attr.videos = None
    assert video_token_budget(cfg, model_config) is None
