"""Step plans with a token budget and data-parallel balance: pure planner checks and the loader's step mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmfsdp.data import StatefulDataLoader
from mmfsdp.data.balance import CostModel, SampleStats, is_filler, plan_step, sample_stats
from mmfsdp.data.loader import plan_epoch_steps

COST = CostModel()


def _mixed_stats(num: int, seed: int = 0) -> SampleStats:
    """Heavy-tailed tokens, 0-3 images of varied patch counts, a third text-only."""
    rng = np.random.default_rng(seed)
    tokens = np.minimum(rng.lognormal(5.0, 1.0, num).astype(np.int64) + 16, 3000)
    grids = []
    for i in range(num):
        count = 0 if i % 3 == 0 else int(rng.integers(1, 4))
        grids.append([(int(rng.integers(2, 40)), int(rng.integers(2, 40))) for _ in range(count)])
    stats = sample_stats(tokens, grids)
    return SampleStats(stats.tokens + stats.patches, stats.patches, stats.patch_sq)


def _load(members, stats, packing):
    tokens, vision = stats.tokens, COST.vision_tokens(stats)
    text = sum(tokens[i] for i in members) if packing else len(members) * max(tokens[i] for i in members)
    return text + sum(vision[i] for i in members)


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("packing", [False, True])
def test_every_sample_once_budget_respected_and_equal_micro_batch_counts(balance, packing):
    stats = _mixed_stats(400)
    budget = 4000
    plans = plan_epoch_steps(
        stats, epoch=0, seed=5, shuffle=True, samples_per_step=48, drop_last=True, dp_size=4, micro_batch_size=3,
        micro_batch_tokens=budget, balance=balance, packing=packing, cost_model=COST,
    )
    assert len(plans) == 400 // 48
    seen = []
    for plan in plans:
        assert len({len(r) for r in plan.ranks}) == 1  # the same number of forward/backward passes on every rank
        step = []
        for micro_batches in plan.ranks:
            for mb in micro_batches:
                entries = [i for row in mb for i in row]
                if any(is_filler(i) for i in entries):
                    assert len(entries) == 1
                    continue
                step += entries
                if len(entries) > 1:
                    assert _load(entries, stats, packing) <= budget
                if packing:
                    assert len(mb) == 1  # one packed row per micro-batch
        assert len(step) == len(set(step)) == 48
        seen += step
    assert len(seen) == len(set(seen))  # no sample twice in the epoch


def test_plans_are_deterministic_in_the_seed_and_reshuffle_per_epoch():
    stats = _mixed_stats(200)
    args = dict(seed=1, shuffle=True, samples_per_step=32, drop_last=True, dp_size=4, micro_batch_size=2,
                micro_batch_tokens=3000, balance=True, packing=False, cost_model=COST)
    first = plan_epoch_steps(stats, epoch=0, **args)
    assert first == plan_epoch_steps(stats, epoch=0, **args)
    assert first != plan_epoch_steps(stats, epoch=1, **args)
    assert first != plan_epoch_steps(stats, epoch=0, **{**args, "seed": 2})


def test_balance_lowers_the_slowest_rank_and_keeps_the_sample_count_without_a_budget():
    stats = _mixed_stats(4096, seed=3)
    order = np.random.default_rng(0).permutation(4096)
    fixed, balanced = [], []
    for s in range(0, 4096, 256):
        idx = order[s:s + 256]
        args = dict(dp_size=16, micro_batch_size=4, micro_batch_tokens=None, packing=False, cost_model=COST)
        fixed.append(plan_step(idx, stats, balance=False, **args))
        balanced.append(plan_step(idx, stats, balance=True, **args))
        # without a budget every rank keeps micro_batch_size × (its share / micro_batch_size) samples
        assert all(sum(len(mb) for mb in r) == 16 for r in balanced[-1].ranks)
        assert balanced[-1].num_micro_batches == 4
    mean_fixed = np.mean([p.imbalance for p in fixed])
    mean_balanced = np.mean([p.imbalance for p in balanced])
    # whole micro-batches of 4 move between ranks (4 per rank): coarser than samples, still far better
    assert mean_balanced - 1 < (mean_fixed - 1) / 3, (mean_balanced, mean_fixed)
    # similar lengths share a micro-batch: less padding
    assert sum(p.num_padded for p in balanced) < sum(p.num_padded for p in fixed)


def test_a_rank_short_of_samples_gets_a_filler_and_splits_come_first():
    stats = SampleStats.text_only([1000, 10, 10, 10, 10, 10, 10, 10])
    plan = plan_step(range(8), stats, dp_size=2, micro_batch_size=4, micro_batch_tokens=1000, balance=True,
                     packing=True, cost_model=COST)
    # rank 0 holds the 1000-token sample alone; rank 1 the seven short ones in one packed row
    assert plan.num_micro_batches == 1
    stats = SampleStats.text_only([1000, 1000, 1000, 10])
    plan = plan_step(range(4), stats, dp_size=2, micro_batch_size=2, micro_batch_tokens=1000, balance=True,
                     packing=True, cost_model=COST)
    counts = sorted(sum(not is_filler(i) for mb in r for row in mb for i in row) for r in plan.ranks)
    assert counts == [2, 2] and plan.num_micro_batches == 2


def test_a_balanced_count_that_does_not_divide_over_the_ranks_is_planned_whole():
    """GRPO's kept completions (dynamic sampling keeps any number): every sample once, the same micro-batch count on
    every rank, fillers where a rank is short; without a budget at most micro_batch_size samples a micro-batch."""
    stats = SampleStats.text_only([90, 10, 50, 30, 70, 20, 60])
    for budget, packing in ((None, False), (100, True), (100, False)):
        plan = plan_step(range(7), stats, dp_size=2, micro_batch_size=2, micro_batch_tokens=budget, balance=True,
                         packing=packing, cost_model=COST)
        real = sorted(i for r in plan.ranks for mb in r for row in mb for i in row if not is_filler(i))
        assert real == list(range(7)), (budget, plan.ranks)
        assert len({len(r) for r in plan.ranks}) == 1
        if budget is None:
            assert all(sum(len(row) for row in mb) <= 2 for r in plan.ranks for mb in r)
    plan = plan_step(range(2), SampleStats.text_only([40, 30]), dp_size=4, micro_batch_size=2, micro_batch_tokens=None,
                     balance=True, packing=False, cost_model=COST)
    assert [[is_filler(i) for mb in r for row in mb for i in row] for r in plan.ranks] == [[False, False], [True],
                                                                                        [True], [True]]


def test_grids_count_vision_blocks_per_image_and_per_video_frame_group():
    stats = sample_stats([10, 20, 30], [[], [(4, 5)], [(1, 6, 6), (3, 2, 2)]])
    assert stats.patches.tolist() == [0, 20, 36 + 12]
    assert stats.patch_sq.tolist() == [0, 400, 36 * 36 + 3 * 16]


def test_cost_model_loads_its_keys_from_json_and_refuses_unknown_ones(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"token": 2.0, "patch": 3.0}))
    model = CostModel.load(path)
    assert (model.token, model.patch, model.sample) == (2.0, 3.0, CostModel().sample)
    path.write_text(json.dumps({"tokn": 1.0}))
    with pytest.raises(ValueError, match="tokn"):
        CostModel.load(path)


class _Rows:
    """A dataset of text rows: sample i is `i` repeated `lengths[i]` times (labels = ids)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        ids = torch.full((int(self.lengths[i]),), i, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def _collate(rows):
    flat = [torch.cat([s["input_ids"] for s in row]) for row in rows]
    labels = [torch.cat([s["labels"] for s in row]) for row in rows]
    width = max(len(f) for f in flat)
    pad = lambda ts, v: torch.stack([torch.nn.functional.pad(t, (0, width - len(t)), value=v) for t in ts])  # noqa: E731
    ids = pad(flat, -1)
    return {"input_ids": ids, "labels": pad(labels, -100), "attention_mask": (ids >= 0).long()}


def _loader(lengths, rank, **kw):
    args = dict(micro_batch_size=2, dp_rank=rank, dp_size=2, seed=7, shuffle=True, packing=False, capacity=10**6,
                drop_last=True, samples_per_step=8, micro_batch_tokens=60, balance=True)
    args.update(kw)
    return StatefulDataLoader(_Rows(lengths), _collate, **args)


def _samples(batch):
    """Trained sample ids of a micro-batch (filler rows have every label masked)."""
    return sorted({int(v) for v in batch["labels"][batch["labels"] >= 0].tolist()})


def test_loader_steps_agree_across_ranks_cover_the_epoch_and_resume_exactly():
    lengths = np.random.default_rng(4).integers(2, 40, 40)
    ranks = [_loader(lengths, r) for r in range(2)]
    steps = [[r.next_step(99) for _ in range(5)] for r in ranks]
    assert [len(s) for s in steps[0]] == [len(s) for s in steps[1]]  # equal micro-batch counts per step
    for mbs in steps[0] + steps[1]:
        for mb in mbs:
            rows = mb["input_ids"].shape[0]
            assert int(mb["attention_mask"].sum(1).max()) * rows <= 60 or rows == 1
    seen = [i for rank_steps in steps for mbs in rank_steps for mb in mbs for i in _samples(mb)]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 40

    # kill after step 2 and resume: the same steps 3.. as the run that went on (and then the next epoch)
    fresh = [_loader(lengths, r) for r in range(2)]
    for r, loader in enumerate(fresh):
        for _ in range(2):
            loader.next_step(99)
        state = loader.state_dict()
        resumed = _loader(lengths, r)
        resumed.load_state_dict(state)
        assert [[_samples(mb) for mb in resumed.next_step(99)] for _ in range(3)] == [
            [_samples(mb) for mb in mbs] for mbs in steps[r][2:5]
        ]
        assert resumed.epoch == 0
        nxt = resumed.next_step(99)
        assert resumed.epoch == 1 and nxt
