"""Every kind of bad row is skipped and counted by reason (or, with strict, stops with file/row/reason)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmfsdp.data import DataError, build_dataloader, build_dataset

Q = "What shape and colour is this?"


def _conv(user: str, assistant: str | None = "a red circle", images: list[str] | None = None) -> dict:
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return {"messages": messages, "images": images or []}


@pytest.fixture()
def bad_file(tmp_path: Path, h) -> tuple[Path, dict[str, int], int]:
    """A JSONL file with good rows and one or more rows of every bad kind; returns it, the counts, the good rows."""
    h.write_image(tmp_path / "small.png", 16, 16)
    h.write_image(tmp_path / "big.png", 64, 64)
    h.write_image(tmp_path / "whole.png", 30, 30)
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])  # header fine, pixels cut off
    (tmp_path / "corrupt.png").write_bytes(b"this is not an image")
    rows = [
        _conv(f"<image>{Q}", images=["small.png"]),                                   # 0 good
        _conv(f"<image>{Q}", images=["missing.png"]),                                 # 1 missing_image
        _conv(f"<image>{Q}", images=["corrupt.png"]),                                 # 2 corrupt_image
        _conv(f"<image><image>{Q}", images=["small.png"]),                            # 3 image_count_mismatch
        _conv(Q, images=["small.png"]),                                               # 4 image_count_mismatch
        {"messages": [], "images": []},                                               # 5 empty_conversation
        _conv(f"<image>{Q}", assistant=None, images=["small.png"]),                   # 6 no_assistant_turn
        {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}]},  # 7 wrong_role_order
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},  # 8 wrong_role_order
        _conv(f"<image>{Q}", images=["big.png"]),                                     # 9 too_long: the cut goes through the image
        "{this is not json",                                                          # 10 bad_content
        {"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "x"}]},  # 11 bad_content
        _conv(Q, assistant="<image> here", images=["small.png"]),                     # 12 image_in_wrong_turn
        _conv(f"<image>{Q}", images=["truncated.png"]),                               # 13 good until decoded: corrupt_image at load
        _conv(Q, assistant="a red circle " * 40),                                     # 14 good, truncated in text
        _conv(f"<image>{Q}", assistant="a blue square", images=["small.png"]),        # 15 good
        {"messages": [{"role": "bot", "content": "?"}]},                              # 16 wrong_role_order (unknown role)
        _conv(f"<image>{Q}", assistant="a red circle " * 40, images=["small.png"]),   # 17 good, truncated after the image
    ]
    counts = {
        "missing_image": 1,
        "corrupt_image": 1,
        "image_count_mismatch": 2,
        "empty_conversation": 1,
        "no_assistant_turn": 1,
        "wrong_role_order": 3,
        "too_long": 1,
        "bad_content": 2,
        "image_in_wrong_turn": 1,
    }
    return h.write_jsonl(tmp_path / "mixed.jsonl", rows), counts, 5


def _cfg(h, tiny_dir, tmp_path, path, **basic):
    return h.data_config(tiny_dir, tmp_path, basic={"dataset": str(path), "shuffle": False, **basic}, preprocess={"cutoff_len": 40})


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.timeout(120)
def test_bad_rows_are_skipped_and_counted(bad_file, tiny_dir, tiny_processor, tmp_path, h):
    path, counts, num_good = bad_file
    records = _Records()
    logging.getLogger("mmfsdp").addHandler(records)
    try:
        dataset = build_dataset(_cfg(h, tiny_dir, tmp_path, path), tiny_processor)
        assert dataset.bad_row_counts == counts
        assert len(dataset) == num_good and dataset.num_rows == 18
        assert [dataset.location(i)[1] for i in range(len(dataset))] == [0, 13, 14, 15, 17]
        assert len(dataset[2]["input_ids"]) == 40  # truncated in text only
        cut = dataset.record(4)
        plugin = dataset.encoder.plugin
        assert len(cut["input_ids"]) == 40 and cut["image_grids"] == [[2, 2]]
        assert sum(t in plugin.image_token_ids for t in cut["input_ids"]) == 2 * 3 and plugin.end_id in cut["input_ids"]
        assert cut["labels"][-1] != -100  # the kept part still trains on the reply

        cfg = _cfg(h, tiny_dir, tmp_path, path)
        cfg.dataloader_param.num_workers = 2
        loader = build_dataloader(dataset, cfg, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0)
        assert loader.batches_per_epoch == 5
        batches = [next(loader) for _ in range(4)]  # the truncated image's batch is empty and skipped
        assert loader.bad_row_counts == {**counts, "corrupt_image": counts["corrupt_image"] + 1}
        assert all("input_ids" in b for b in batches)
        next(loader)  # ends epoch 0, starts epoch 1
        assert loader.epoch == 1
    finally:
        logging.getLogger("mmfsdp").removeHandler(records)
    epoch_logs = [m for m in records.messages if m.startswith("data: epoch 0 done")]
    assert epoch_logs and "corrupt_image=2" in epoch_logs[0] and "wrong_role_order=3" in epoch_logs[0]
    assert any("skipped 13" in m and "missing_image=1" in m for m in records.messages)


def test_strict_stops_at_the_first_bad_row(bad_file, tiny_dir, tiny_processor, tmp_path, h):
    path, _, _ = bad_file
    with pytest.raises(DataError, match=r"mixed\.jsonl row 1: missing_image: .*missing\.png does not exist") as err:
        build_dataset(_cfg(h, tiny_dir, tmp_path, path, strict=True), tiny_processor)
    assert "\n" not in str(err.value)


def test_strict_stops_at_an_image_that_fails_to_decode(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "whole.png", 30, 30)
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    path = h.write_jsonl(tmp_path / "t.jsonl", [_conv(f"<image>{Q}", images=["whole.png"]), _conv(f"<image>{Q}", images=["truncated.png"])])
    cfg = _cfg(h, tiny_dir, tmp_path, path, strict=True)
    cfg.dataloader_param.num_workers = 2
    loader = build_dataloader(build_dataset(cfg, tiny_processor), cfg, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0)
    next(loader)
    with pytest.raises(DataError, match=r"^\S*t\.jsonl row 1: corrupt_image: .*truncated\.png cannot be decoded") as err:
        next(loader)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)  # one line, though raised in a worker


def test_every_row_bad_is_a_clear_error(tiny_dir, tiny_processor, tmp_path, h):
    path = h.write_jsonl(tmp_path / "allbad.jsonl", [_conv(f"<image>{Q}", images=["nope.png"]), {"messages": []}])
    with pytest.raises(DataError, match=r"every one of the 2 rows of allbad\.jsonl is bad \(empty_conversation=1, missing_image=1\)") as err:
        build_dataset(_cfg(h, tiny_dir, tmp_path, path), tiny_processor)
    assert "\n" not in str(err.value)


def test_every_image_failing_at_load_is_an_error_not_an_endless_loop(tiny_dir, tiny_processor, tmp_path, h):
    h.write_image(tmp_path / "whole.png", 30, 30)
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    path = h.write_jsonl(tmp_path / "t.jsonl", [_conv(f"<image>{Q}", images=["truncated.png"])] * 3)
    cfg = _cfg(h, tiny_dir, tmp_path, path)
    loader = build_dataloader(build_dataset(cfg, tiny_processor), cfg, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(DataError, match="epoch 0 produced no batch: every sample was bad \\(corrupt_image=3\\)"):
        next(loader)
