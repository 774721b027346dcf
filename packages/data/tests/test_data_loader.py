"""The stateful loader: deterministic per-epoch plans, disjoint data-parallel shards, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmfsdp.data import DataError, build_dataloader, build_dataset, pack_rows, plan_epoch, prepare_dataset
from mmfsdp.data.synthetic import make_shapes_dataset


def _plan(lengths, **kw):
    args = dict(epoch=0, seed=3, shuffle=True, packing=False, capacity=100, micro_batch_size=2, dp_rank=0, dp_size=1, drop_last=True)
    args.update(kw)
    return plan_epoch(np.asarray(lengths), **args)


def _flat(plan):
    return [i for key in plan for row in key for i in row]


@pytest.mark.parametrize("packing", [False, True])
def test_ranks_get_disjoint_samples_and_epochs_reshuffle(packing):
    lengths = np.random.default_rng(0).integers(5, 60, 50)
    shards = [_flat(_plan(lengths, dp_rank=r, dp_size=3, packing=packing)) for r in range(3)]
    seen = [i for s in shards for i in s]
    assert len(seen) == len(set(seen))
    assert len({len(p) for p in (_plan(lengths, dp_rank=r, dp_size=3, packing=packing) for r in range(3))}) == 1
    assert _plan(lengths, dp_size=3, packing=packing) == _plan(lengths, dp_size=3, packing=packing)
    assert _flat(_plan(lengths, epoch=0, packing=packing)) != _flat(_plan(lengths, epoch=1, packing=packing))


def test_drop_last_false_covers_every_sample():
    lengths = np.full(11, 10)
    plans = [_plan(lengths, dp_rank=r, dp_size=2, drop_last=False) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 3
    assert set(_flat(plans[0]) + _flat(plans[1])) == set(range(11))
    assert len(_plan(lengths, dp_rank=0, dp_size=2, drop_last=True)) == 2


def test_no_shuffle_keeps_file_order():
    assert _flat(_plan(np.full(6, 1), shuffle=False)) == list(range(6))


def test_first_fit_packing_respects_capacity_and_keeps_every_sample():
    lengths = np.random.default_rng(1).integers(1, 100, 300)
    order = np.random.default_rng(2).permutation(300)
    rows = pack_rows(order, lengths, 100)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(sum(lengths[i] for i in r) <= 100 for r in rows)
    assert len(rows) < 0.7 * 300


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, tiny_dir, h):
    root = tmp_path_factory.mktemp("loader")
    make_shapes_dataset(root / "shapes", num_train=14, num_eval=4, image_size=32, seed=0)
    return root


def _loader_factory(shapes, tiny_dir, h, tiny_processor, padding_free=True, **basic):
    cfg = h.data_config(
        tiny_dir,
        shapes,
        basic={"dataset_dir": str(shapes / "shapes"), "dataset": str(shapes / "shapes" / "train.jsonl"), **basic},
        preprocess={"cutoff_len": 80},
        loader={"padding_free": padding_free},
    )
    dataset = build_dataset(cfg, tiny_processor)

    def make(num_workers=0, dp_rank=0, dp_size=1):
        cfg.dataloader_param.num_workers = num_workers
        return build_dataloader(dataset, cfg, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=5, pad_to_multiple_of=4)

    return make


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize(("layout", "num_workers"), [("padded", 0), ("padding_free", 0), ("packing", 0), ("padded", 2)])
def test_resume_yields_exactly_the_next_batches(shapes, tiny_dir, h, tiny_processor, layout, num_workers):
    make = _loader_factory(shapes, tiny_dir, h, tiny_processor, packing=layout == "packing",
                           padding_free=layout == "padding_free")
    original = make(num_workers)
    per_epoch = original.batches_per_epoch
    for _ in range(per_epoch - 1):
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(per_epoch + 2)]  # crosses into the next two epochs
    assert original.epoch == 2
    restored = make(num_workers)
    restored.load_state_dict(state)
    got = [next(restored) for _ in range(per_epoch + 2)]
    assert all(_same(a, b) for a, b in zip(expected, got))
    assert restored.state_dict() == original.state_dict()
    batch = expected[0]
    assert batch["input_ids"].shape[1] % 4 == 0
    assert ("cu_seq_lens" in batch) == (layout != "padded")
    # padding-free: the micro-batch's 2 samples end to end in one row, no padding between them
    if layout != "packing":
        assert batch["input_ids"].shape[0] == (1 if layout == "padding_free" else 2)
    assert batch["pixel_values"].dtype == torch.float32 and batch["image_sizes"].dtype == torch.long


def test_workers_give_the_same_batches_as_the_main_process(shapes, tiny_dir, h, tiny_processor):
    make = _loader_factory(shapes, tiny_dir, h, tiny_processor)
    main, workers = make(0), make(2)
    assert all(_same(next(main), next(workers)) for _ in range(5))


def test_dp_ranks_split_each_epoch(shapes, tiny_dir, h, tiny_processor):
    make = _loader_factory(shapes, tiny_dir, h, tiny_processor, shuffle=False)
    ranks = [make(dp_rank=r, dp_size=2) for r in range(2)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == 3  # 14 samples, global batch 4, drop_last
    answers = [[tuple(next(loader)["input_ids"][:, -6:].flatten().tolist()) for _ in range(3)] for loader in ranks]
    assert answers[0] != answers[1]


def test_too_small_for_one_global_batch_is_a_clear_error(shapes, tiny_dir, h, tiny_processor):
    make = _loader_factory(shapes, tiny_dir, h, tiny_processor)
    with pytest.raises(DataError, match="too few samples for one global batch"):
        next(make(dp_rank=0, dp_size=8))


def test_synthetic_shapes_type_generates_on_first_use(tmp_path, h):
    from mmfsdp.config import build
    from mmfsdp.data import DataConfig, build_processor

    raw = {
        "dataset_param": {
            "dataset_type": "synthetic_shapes",
            "preprocess_parameters": {"model_name_or_path": str(tmp_path / "tiny"), "template": "mistral", "cutoff_len": 64},
            "basic_parameters": {"dataset_dir": str(tmp_path / "shapes"), "cache_dir": str(tmp_path / "cache")},
            "synthetic": {"num_train": 8, "num_eval": 4, "image_size": 32, "patch_size": 4, "spatial_merge_size": 2},
        },
        "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "pixtral"}},
    }
    cfg = build(DataConfig, raw, "data")
    prepare_dataset(cfg)
    processor = build_processor(cfg)
    train, evaluation = build_dataset(cfg, processor, "train"), build_dataset(cfg, processor, "eval")
    assert (len(train), len(evaluation)) == (8, 4)
    batch = next(build_dataloader(evaluation, cfg, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0))
    assert batch["pixel_values"].shape == (4, 3, 32, 32)
