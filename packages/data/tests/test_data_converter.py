"""tools/data/llava_instruct_to_mllm.py turns LLaVA-Instruct rows into mllm rows the loader reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mmfsdp.data import build_dataset

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "data" / "llava_instruct_to_mllm.py"


@pytest.fixture(scope="module")
def converter():
    spec = importlib.util.spec_from_file_location("llava_instruct_to_mllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llava(tmp_path: Path, h) -> Path:
    coco = tmp_path / "data" / "COCO2017" / "train2017"
    h.write_image(coco / "000000033471.jpg", 40, 30)
    h.write_image(coco / "000000052846.jpg", 30, 40, seed=1)
    rows = [
        {"id": "000000033471", "image": "000000033471.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
            {"from": "gpt", "value": "The bus in the image is white and red."},
            {"from": "human", "value": "What feature can be seen on the back of the bus?"},
            {"from": "gpt", "value": "The back of the bus features an advertisement."},
        ]},
        {"id": "000000052846", "image": "000000052846.jpg", "conversations": [
            {"from": "human", "value": "Is the person riding a skateboard?\n<image>"}, {"from": "gpt", "value": "Yes."}]},
        {"id": "000000000001", "image": "000000000001.jpg", "conversations": [{"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello"}]},
        {"id": "bad", "conversations": [{"from": "robot", "value": "?"}]},
    ]
    path = tmp_path / "data" / "llava_instruct_150k.json"
    path.write_text(json.dumps(rows))
    return path


def test_converts_and_loads(converter, tmp_path, h, tiny_dir, tiny_processor, capsys):
    source = _llava(tmp_path, h)
    data = tmp_path / "data"
    out = data / "mllm_format_llava_instruct_data.json"
    assert converter.main(["--input", str(source), "--image-dir", str(data / "COCO2017" / "train2017"), "--dataset-dir", str(data), "--output", str(out)]) == 0
    assert "wrote 3 of 4 rows" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rows[0] == {
        "images": ["COCO2017/train2017/000000033471.jpg"],
        "messages": [
            {"role": "user", "content": "<image>\nWhat are the colors of the bus in the image?"},
            {"role": "assistant", "content": "The bus in the image is white and red."},
            {"role": "user", "content": "What feature can be seen on the back of the bus?"},
            {"role": "assistant", "content": "The back of the bus features an advertisement."},
        ],
    }
    dataset = build_dataset(h.data_config(tiny_dir, data, basic={"dataset": str(out), "dataset_dir": str(data)}), tiny_processor)
    assert len(dataset) == 2 and dataset.bad_row_counts == {"missing_image": 1}


def test_check_images_and_jsonl_output(converter, tmp_path, h):
    source = _llava(tmp_path, h)
    data = tmp_path / "data"
    out = data / "out.jsonl"
    assert converter.main(["--input", str(source), "--image-dir", str(data / "COCO2017" / "train2017"), "--dataset-dir", str(data), "--output", str(out), "--check-images"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["images"] == ["COCO2017/train2017/000000052846.jpg"]
