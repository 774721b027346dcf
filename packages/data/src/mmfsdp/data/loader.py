"""The endless, stateful, data-parallel loader.

Every epoch has a *plan*, computed the same way on every rank from
`(seed, epoch, lengths)` alone (`plan_epoch`, pure):

1. the sample order: a permutation drawn from `numpy.random.default_rng(seed + epoch)`
   (or the file order with `shuffle: false`);
2. rows: one sample each, or with packing samples placed first-fit (in that order,
   over a window of recently opened rows) into rows of at most `cutoff_len` tokens,
   counted *without* any padding, so the rows do not depend on the parallel layout;
3. global batches of `dp_size × micro_batch_size` rows; data-parallel rank `r` takes
   rows `[r·mbs, (r+1)·mbs)` of each. Ranks therefore never share a row. With
   `drop_last: false` the last global batch is filled by repeating the epoch's first
   rows — the only case in which a sample is seen twice in an epoch.

Context parallel: all ranks of one CP group are given the same `dp_rank`, so they
load the same batches and the model splits the sequence. The collator pads every
packed sample to CP's multiple (`sample_multiple`) only after the rows are planned:
a row holds the same samples for every ring / Ulysses size, CP = 1 included, and
may be up to `sample_multiple - 1` tokens per sample longer than `cutoff_len`.

The loader yields batch after batch forever; `epoch` counts up. Its state is just
`(epoch, batches consumed in this epoch)` — counted when a batch is handed out, not
when a worker prefetches it — so `load_state_dict` recomputes the plan and continues
with exactly the batch the original would have yielded next, whatever
`num_workers` is. Workers (`num_workers > 0`) read items and collate; a sample whose
images fail to decode is dropped from its batch and counted (a batch left empty is
skipped), and the counts, with the rows dropped while preprocessing, are logged at
the end of every epoch.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import Counter
from typing import Any

import numpy as np
import torch

from mmfsdp.config import get_logger, warn_once

from mmfsdp.data.balance import CostModel, SampleStats, StepPlan, is_filler, plan_step, sample_stats
from mmfsdp.data.collators import PairCollator, PromptCollator, get_collator
from mmfsdp.data.config import DataConfig
from mmfsdp.data.errors import BAD_REASON_ADVICE, BAD_REASONS, DataError, format_counts, top_reason

__all__ = ["StatefulDataLoader", "build_dataloader", "pack_rows", "plan_epoch", "plan_epoch_steps"]

log = get_logger(__name__)

BatchKey = tuple[tuple[int, ...], ...]
"""One micro-batch: its rows, each a tuple of dataset indices."""

_PACK_WINDOW = 64
"""How many recently opened rows first-fit packing tries before opening a new one."""


def pack_rows(order: np.ndarray, lengths: np.ndarray, capacity: int) -> list[tuple[int, ...]]:
    """First-fit packing of samples (taken in `order`) into rows of at most `capacity` tokens."""
    rows: list[list[int]] = []
    space: list[int] = []
    open_rows: list[int] = []
    for idx in order.tolist():
        n = int(lengths[idx])
        assert n <= capacity, f"sample {idx} has {n} tokens > packing capacity {capacity}"
        for r in open_rows:
            if space[r] >= n:
                rows[r].append(idx)
                space[r] -= n
                break
        else:
            rows.append([idx])
            space.append(capacity - n)
            open_rows.append(len(rows) - 1)
            if len(open_rows) > _PACK_WINDOW:
                open_rows.pop(0)
    return [tuple(r) for r in rows]


def plan_epoch(
    lengths: np.ndarray,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    packing: bool,
    capacity: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    drop_last: bool,
) -> list[BatchKey]:
    """The micro-batches rank `dp_rank` loads in `epoch`, in order."""
    assert 0 <= dp_rank < dp_size and micro_batch_size >= 1
    num_samples = len(lengths)
    order = np.random.default_rng(seed + epoch).permutation(num_samples) if shuffle else np.arange(num_samples)
    rows = pack_rows(order, lengths, capacity) if packing else [(int(i),) for i in order]
    per_step = dp_size * micro_batch_size
    num_steps = len(rows) // per_step if drop_last else math.ceil(len(rows) / per_step)
    if num_steps * per_step > len(rows):
        rows = [rows[i % len(rows)] for i in range(num_steps * per_step)]
    first = dp_rank * micro_batch_size
    return [tuple(rows[s * per_step + first : s * per_step + first + micro_batch_size]) for s in range(num_steps)]


def plan_epoch_steps(
    stats: SampleStats,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    samples_per_step: int,
    drop_last: bool,
    **plan_args: Any,
) -> list[StepPlan]:
    """Every step of `epoch` planned for all ranks (`mmfsdp.data.balance.plan_step`): the epoch's order
    (as `plan_epoch`) cut into steps of `samples_per_step` samples; with `drop_last: false` the last step is
    filled with the epoch's first samples."""
    num_samples = len(stats.tokens)
    order = np.random.default_rng(seed + epoch).permutation(num_samples) if shuffle else np.arange(num_samples)
    num_steps = num_samples // samples_per_step if drop_last else math.ceil(num_samples / samples_per_step)
    if num_steps * samples_per_step > num_samples:
        order = np.resize(order, num_steps * samples_per_step)
    steps = [order[s * samples_per_step:(s + 1) * samples_per_step] for s in range(num_steps)]
    return [plan_step(indices, stats, **plan_args) for indices in steps]


def _masked(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch (or sample, or pair) with every label ignored: it runs the model (and its collectives) and trains
    nothing."""
    if "chosen" in batch:
        return {**batch, "chosen": _masked(batch["chosen"]), "rejected": _masked(batch["rejected"])}
    return {**batch, "labels": torch.full_like(batch["labels"], -100)}


class _BatchView(torch.utils.data.Dataset):
    """Indexed by a whole `BatchKey`: reads its samples and collates them (inside a worker); with `flatten`
    (padding-free micro-batches) all its samples go end to end into one row."""

    def __init__(self, dataset: Any, collator: Any, flatten: bool = False):
        self.dataset = dataset
        self.collator = collator
        self.flatten = flatten

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: BatchKey) -> tuple[dict[str, Any] | None, dict[str, int]]:
        bad: Counter[str] = Counter()
        rows = []
        for row in key:
            samples = []
            for idx in row:
                filler = is_filler(idx)
                item = self.dataset[-1 - idx if filler else idx]
                if "bad_reason" in item:
                    bad[item["bad_reason"]] += 1
                elif filler:
                    samples.append(_masked(item))
                else:
                    samples.append(item)
            if samples:
                rows.append(samples)
        if self.flatten and rows:
            rows = [[sample for row in rows for sample in row]]
        return (self.collator(rows) if rows else None), dict(bad)


def _passthrough(item: Any) -> Any:
    return item


def _pin_memory_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


class StatefulDataLoader:
    """Endless iterator over collated micro-batches with exact `state_dict()` / `load_state_dict()`."""

    def __init__(
        self,
        dataset: Any,
        collator: Any,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        packing: bool,
        capacity: int,
        drop_last: bool,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        samples_per_step: int | None = None,
        micro_batch_tokens: int | None = None,
        balance: bool = False,
        cost_model: CostModel | None = None,
        padding_free: bool = False,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.dataset = dataset
        self.collator = collator
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.packing = packing
        self.padding_free = padding_free
        """Each micro-batch's rows end to end in one row (`cu_seq_lens`), not padded to the longest; the
        collator must pack (`packing=True`). The plan (which samples, which micro-batch) is the same either way."""
        self.capacity = capacity
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory and _pin_memory_available()
        self.prefetch_factor = prefetch_factor
        self.samples_per_step = samples_per_step
        """Step mode (a token budget or balance): samples of one optimizer step over all ranks; None: fixed layout."""
        self.micro_batch_tokens = micro_batch_tokens
        self.balance = balance
        self.cost_model = cost_model or CostModel()
        self._stats: SampleStats | None = None
        self._step_ends: list[int] = []
        """Step mode: this epoch's cumulative micro-batch counts at the end of every step."""
        self._step_plans: list[StepPlan] = []
        self.current_step_plan: StepPlan | None = None
        """Step mode: the plan of the step `next_step` returned last (all ranks' micro-batches and costs)."""
        self.epoch = 0
        """The epoch the next batch comes from."""
        self.batch_in_epoch = 0
        """Micro-batches of this epoch already handed out (including skipped empty ones)."""
        self._plan: list[BatchKey] | None = None
        self._iter: Any = None
        self._yielded_in_epoch = 0
        self._runtime_bad: Counter[str] = Counter()

    # ------------------------------------------------------------ planning

    @property
    def step_mode(self) -> bool:
        return self.samples_per_step is not None

    @property
    def stats(self) -> SampleStats:
        """The samples' planning statistics (tokens, vision patches), read once from the dataset."""
        if self._stats is None:
            read = getattr(self.dataset, "sample_stats", None)
            self._stats = read() if callable(read) else sample_stats(np.asarray(self.dataset.lengths))
        return self._stats

    def _epoch_steps(self, epoch: int) -> list[BatchKey]:
        self._step_plans = plan_epoch_steps(
            self.stats, epoch=epoch, seed=self.seed, shuffle=self.shuffle, samples_per_step=self.samples_per_step,
            drop_last=self.drop_last, dp_size=self.dp_size, micro_batch_size=self.micro_batch_size,
            micro_batch_tokens=self.micro_batch_tokens, balance=self.balance,
            # a padding-free micro-batch costs its samples' tokens, as a packed row does, not rows × the longest
            packing=self.packing or (self.padding_free and self.micro_batch_tokens is not None),
            cost_model=self.cost_model,
        )
        self._step_ends = np.cumsum([p.num_micro_batches for p in self._step_plans]).tolist()
        return [key for p in self._step_plans for key in p.ranks[self.dp_rank]]

    def _epoch_plan(self, epoch: int) -> list[BatchKey]:
        if self.step_mode:
            plan = self._epoch_steps(epoch)
            if not plan:
                raise DataError(
                    f"the dataset has {len(self.dataset)} samples, fewer than one step's {self.samples_per_step}; "
                    "lower micro_batch_size or gradient_accumulation_steps, or set dataloader_param.drop_last: false"
                )
            return plan
        plan = plan_epoch(
            np.asarray(self.dataset.lengths),
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            packing=self.packing,
            capacity=self.capacity,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            drop_last=self.drop_last,
        )
        if not plan:
            what = "packed rows" if self.packing else "samples"
            raise DataError(
                f"the dataset has too few {what} for one global batch of dp_size {self.dp_size} × micro_batch_size "
                f"{self.micro_batch_size}; lower micro_batch_size or set dataloader_param.drop_last: false"
            )
        return plan

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches this rank loads in the current epoch (with packing it can change between epochs)."""
        if self._plan is None:
            self._plan = self._epoch_plan(self.epoch)
        return len(self._plan)

    @property
    def bad_row_counts(self) -> dict[str, int]:
        """Rows skipped this epoch by reason: those dropped while preprocessing plus decode failures this rank met."""
        counts = Counter(getattr(self.dataset, "bad_row_counts", {})) + self._runtime_bad
        return {r: counts[r] for r in BAD_REASONS if counts[r]}

    # ------------------------------------------------------------ iteration

    def _start_iter(self) -> None:
        if self._plan is None:
            self._plan = self._epoch_plan(self.epoch)
        keys = self._plan[self.batch_in_epoch :]
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            # Workers only decode images; keep HF tokenizers from warning (and
            # disabling themselves) in every forked worker.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            kwargs["prefetch_factor"] = self.prefetch_factor
        loader = torch.utils.data.DataLoader(
            _BatchView(self.dataset, self.collator, flatten=self.padding_free),
            sampler=keys,
            batch_size=None,
            collate_fn=_passthrough,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            **kwargs,
        )
        self._iter = iter(loader)

    def _end_epoch(self) -> None:
        counts = self.bad_row_counts
        if self._yielded_in_epoch == 0:
            self.close()
            top = top_reason(counts)
            advice = f". Fix: {BAD_REASON_ADVICE[top]}" if top else ""
            raise DataError(
                f"epoch {self.epoch} produced no batch: every sample was bad ({format_counts(counts)}){advice}"
            )
        log.info(
            "data: epoch %d done: %d batches%s",
            self.epoch,
            self._yielded_in_epoch,
            f"; skipped rows: {format_counts(counts)}" if counts else "",
        )
        self.epoch += 1
        self.batch_in_epoch = 0
        self._yielded_in_epoch = 0
        self._runtime_bad = Counter()
        self._plan = None
        self._iter = None

    def __iter__(self) -> "StatefulDataLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._iter is None:
                self._start_iter()
            try:
                batch, bad = self._next_item()
            except StopIteration:
                self._end_epoch()
                continue
            self.batch_in_epoch += 1
            self._runtime_bad.update(bad)
            if batch is None:
                continue
            self._yielded_in_epoch += 1
            return batch

    def _next_item(self) -> tuple[dict[str, Any] | None, Counter]:
        try:
            return next(self._iter)
        except StopIteration:
            raise
        except BaseException:  # a worker's error (strict's DataError, an interrupt): its workers stop with it
            self.close()
            raise

    def next_step(self, num_micro_batches: int) -> list[dict[str, Any]]:
        """The micro-batches of the next optimizer step: `num_micro_batches` of them in the fixed layout; in
        step mode as many as the step's plan has (the same number on every rank; a micro-batch whose samples
        all failed to decode is replaced by a masked copy of another, so the count holds)."""
        if not self.step_mode:
            return [next(self) for _ in range(num_micro_batches)]
        if self._plan is None:
            self._plan = self._epoch_plan(self.epoch)
        if self.batch_in_epoch >= len(self._plan):
            self._end_epoch()
            self._plan = self._epoch_plan(self.epoch)
        step = bisect.bisect_right(self._step_ends, self.batch_in_epoch)
        self.current_step_plan = self._step_plans[step]
        count = self._step_ends[step] - self.batch_in_epoch
        if self._iter is None:
            self._start_iter()
        batches = []
        for _ in range(count):
            batch, bad = self._next_item()
            self.batch_in_epoch += 1
            self._runtime_bad.update(bad)
            if batch is not None:
                self._yielded_in_epoch += 1
            batches.append(batch)
        kept = [b for b in batches if b is not None]
        if not kept:
            raise DataError(
                f"every sample of step {step} of epoch {self.epoch} failed to decode "
                f"({format_counts(self._runtime_bad)})"
            )
        return [b if b is not None else _masked(kept[0]) for b in batches]

    def close(self) -> None:
        """Stop the worker processes now (a later `next` starts new ones where this left off). Dropping the
        iterator alone leaves them to its finaliser, which may run only at a later garbage collection, somewhere
        else in the program: each then waits for its workers."""
        iterator, self._iter = self._iter, None
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "yielded_in_epoch": self._yielded_in_epoch,
            "runtime_bad": dict(self._runtime_bad),
            "seed": self.seed,
            "dp_size": self.dp_size,
            "micro_batch_size": self.micro_batch_size,
            "num_samples": len(self.dataset),
            "packing": self.packing,
            "padding_free": self.padding_free,
            "micro_batch_tokens": self.micro_batch_tokens,
            "balance": self.balance,
            "samples_per_step": self.samples_per_step,
            "step_in_epoch": bisect.bisect_right(self._step_ends, self.batch_in_epoch),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: exactly where it was if seed, dataset and batch layout are unchanged."""
        self.close()
        if self.step_mode:
            self._load_step_state(state)
            return
        batch_in_epoch = int(state["batch_in_epoch"])
        changed = [k for k in ("seed", "num_samples", "packing") if state.get(k) != self.state_dict()[k]]
        old_rows = int(state.get("dp_size", self.dp_size)) * int(state.get("micro_batch_size", self.micro_batch_size))
        new_rows = self.dp_size * self.micro_batch_size
        if old_rows != new_rows:
            changed.append("dp_size × micro_batch_size")
            batch_in_epoch = batch_in_epoch * old_rows // new_rows
        if changed:
            warn_once(f"data loader resumed with a different {', '.join(changed)}; the sample order will not continue exactly", log)
        self.epoch = int(state["epoch"])
        self._plan = self._epoch_plan(self.epoch)
        self.batch_in_epoch = min(batch_in_epoch, len(self._plan))
        self._yielded_in_epoch = int(state.get("yielded_in_epoch", self.batch_in_epoch))
        self._runtime_bad = Counter(state.get("runtime_bad", {}))

    def _load_step_state(self, state: dict[str, Any]) -> None:
        """Step mode: continue at the step after the saved one (steps are whole in a checkpoint); with another
        number of samples per step, at the step that holds the same sample offset of the epoch."""
        mine = self.state_dict()
        keys = ("seed", "num_samples", "packing", "micro_batch_tokens", "balance")
        changed = [k for k in keys if state.get(k) != mine[k]]
        # a token budget counts a padding-free micro-batch's summed tokens (checkpoints before it: padded)
        if self.micro_batch_tokens is not None and bool(state.get("padding_free", False)) != self.padding_free:
            changed.append("padding_free")
        old_step_samples = state.get("samples_per_step")
        if old_step_samples is None:
            changed.append("batch layout (the checkpoint has no token-budget step plan)")
            offset = int(state["batch_in_epoch"]) * int(state.get("dp_size", 1)) * int(state.get("micro_batch_size", 1))
        else:
            offset = int(state["step_in_epoch"]) * int(old_step_samples)
            if old_step_samples != self.samples_per_step:
                changed.append("samples per step")
        if changed:
            warn_once(
                f"data loader resumed with a different {', '.join(changed)}; "
                "the sample order will not continue exactly",
                log,
            )
        self.epoch = int(state["epoch"])
        self._plan = self._epoch_plan(self.epoch)
        step = min(offset // self.samples_per_step, len(self._step_ends))
        self.batch_in_epoch = self._step_ends[step - 1] if step else 0
        self._yielded_in_epoch = int(state.get("yielded_in_epoch", self.batch_in_epoch))
        self._runtime_bad = Counter(state.get("runtime_bad", {}))


def build_dataloader(
    dataset: Any,
    data_cfg: DataConfig,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    pad_to_multiple_of: int = 1,
    sample_multiple: int = 1,
    gradient_accumulation_steps: int = 1,
    micro_batch_tokens: int | None = None,
) -> StatefulDataLoader:
    """The endless loader of `dataset` for one data-parallel rank.

    `pad_to_multiple_of` (e.g. 2 × ring × ulysses for context parallel) is combined
    with `collate_param.pad_to_multiple_of` by least common multiple.
    `sample_multiple` (context parallel's `required_multiple`) pads every packed
    sample to a multiple of it. Packing plans rows with the unpadded lengths, so the
    rows are the same whatever `sample_multiple` is (the padding is added to the row).
    `seed` is the training seed; `basic_parameters.seed`, when set, takes its place.
    With `micro_batch_tokens` or `dataloader_param.balance` the loader plans whole steps of
    `dp_size × micro_batch_size × gradient_accumulation_steps` samples (`mmfsdp.data.balance`); take them
    with `next_step`.
    A preference dataset (`is_preference`) is planned in pairs (`micro_batch_size` counts pairs; a packed row
    holds up to 2 × `cutoff_len` tokens of whole pairs) and collated by `PairCollator` (docs/data.md,
    "Preference data").
    A prompt dataset (`is_prompt`, online RL) gives micro-batches `{"prompts": [item, ...]}` (`PromptCollator`).
    """
    basic = data_cfg.dataset_param.basic_parameters
    loader_cfg = data_cfg.dataloader_param
    collate = loader_cfg.collate_param
    padding_free = loader_cfg.padding_free is not False and not basic.packing
    collator = get_collator(collate.model_name)(
        pad_token_id=dataset.processor.pad_token_id,
        pad_to_multiple_of=math.lcm(collate.pad_to_multiple_of, pad_to_multiple_of),
        packing=basic.packing or padding_free,
        sample_multiple=sample_multiple,
    )
    preference = getattr(dataset, "is_preference", False)
    if preference:
        collator = PairCollator(collator)
    elif getattr(dataset, "is_prompt", False):
        collator = PromptCollator(collator)
    return StatefulDataLoader(
        dataset,
        collator,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=basic.seed if basic.seed is not None else seed,
        shuffle=basic.shuffle,
        packing=basic.packing,
        # a pair is one unit of the plan: a packed row holds whole pairs, each sequence within cutoff_len
        capacity=data_cfg.dataset_param.preprocess_parameters.cutoff_len * (2 if preference else 1),
        drop_last=loader_cfg.drop_last,
        num_workers=loader_cfg.num_workers,
        pin_memory=loader_cfg.pin_memory,
        prefetch_factor=loader_cfg.prefetch_factor,
        samples_per_step=dp_size * micro_batch_size * gradient_accumulation_steps
        if micro_batch_tokens is not None or loader_cfg.balance else None,
        micro_batch_tokens=micro_batch_tokens,
        balance=loader_cfg.balance,
        cost_model=CostModel.load(loader_cfg.cost_model),
        padding_free=padding_free,
    )
