"""Step plans: which samples each data-parallel rank runs in which micro-batch, with a token budget and a
cost model that balances the ranks.

A *step* is one optimizer step's global batch: a fixed number of samples (`samples_per_step` =
`dp_size × micro_batch_size × gradient_accumulation_steps`), taken in the epoch's order. `plan_step`
splits them over the ranks and into micro-batches, the same way on every rank (a pure function of the
samples' statistics, no RNG, ties broken by index), so that

1. every sample of the step is in exactly one micro-batch of one rank;
2. every rank gets the same number of micro-batches `M` — FSDP2's collectives run once per forward and
   backward, so a rank that ran one micro-batch more would wait forever. A rank that holds fewer
   micro-batches splits its largest ones; one with fewer samples than `M` gets *filler* micro-batches: a
   sample of its own (rows `(-1 - index,)`) whose labels the loader masks, so it runs the collectives and
   adds exactly zero to the loss and the gradients;
3. with `micro_batch_tokens` a micro-batch holds at most that many tokens, counted as the row layout
   spends them: padded (rows × longest row) without packing, summed with packing or padding-free
   micro-batches (the loader passes `packing=True` for both: the whole micro-batch is one packed row) — plus the vision work of its images in token equivalents
   (`CostModel.vision_tokens`). A sample heavier than the budget alone gets a micro-batch of its own;
4. with `balance` the samples go to ranks by LPT (longest processing time first: heaviest sample to the
   least-loaded rank) on `CostModel.sample_cost`, which minimises the slowest rank's cost within 4/3 of
   the optimum, and within a rank the micro-batches are filled first-fit by decreasing length (similar
   lengths together, so little padding). Without `balance` each rank takes its contiguous share of the
   step in order (the fixed layout), and micro-batches fill in that order.

Loss normalisation is untouched: the trainer computes every token's weight from all micro-batches of the
step with counts summed over the data-parallel group (`mmfsdp.model.compute_loss_weights`), which is exact
for any split of the step's samples into ranks and micro-batches; filler rows train no token.

Context parallel: the ranks of one CP group share a `dp_rank` and load the same plan. Expert parallel and
HSDP: EP and replica ranks are data-parallel ranks here, like any other. Packing without a budget keeps
the packed-row layout of `mmfsdp.data.loader.plan_epoch`.

The cost model counts the vision encoder and the decoder separately:

    cost(sample) = sample + token · n + token_sq · n² + patch · Σ p_i + patch_sq · Σ p_i²

with `n` the sample's tokens and `p_i` the patches of each vision attention block (an image; a video's
frame group). Its coefficients are data: `CostModel`'s defaults (FLOP-proportional, a Magistral-class model on
a GPU), or a JSON file of the same keys (`data.dataloader_param.cost_model`), e.g. the one
`tools/bench/balance_calibrate.py --out` fits to measured step times.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "CostModel", "SampleStats", "StepPlan", "fill_budget", "plan_step", "sample_stats", "filler_index", "is_filler",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Seconds of forward + backward per unit. The defaults are FLOP-proportional for a Magistral-Small-class
    model (24B decoder, 0.4B Pixtral encoder) at 400 TFLOP/s, a GPU's order of magnitude; on another model or
    machine calibrate (`tools/bench/balance_calibrate.py`, docs/data.md#the-cost-model) and give the JSON to
    `data.dataloader_param.cost_model`. Only the ratios matter for balancing; the token equivalents of vision
    work divide by `token`."""

    sample: float = 0.0
    """Per sample (row bookkeeping, the loss)."""
    token: float = 3.5e-4
    """Per language token (image tokens included): the decoder's matrix products, 6 × 23.6e9 FLOPs."""
    token_sq: float = 3.1e-9
    """Per squared sample length: the decoder's causal attention, 3 × 2 × 40 layers × 5,120 FLOPs per pair."""
    patch: float = 6.0e-6
    """Per vision patch: the encoder's matrix products, 6 × 0.4e9 FLOPs."""
    patch_sq: float = 7.4e-10
    """Per squared patch count of one image (or video frame group): the encoder's attention, 3 × 4 × 24 layers ×
    1,024 FLOPs per pair."""
    micro_batch: float = 5.0e-3
    """Per micro-batch: the fixed cost of one forward and backward (FSDP2 gathers not hidden, launches)."""

    @classmethod
    def load(cls, path: str | Path | None) -> "CostModel":
        """The defaults, with the keys of the JSON object in `path` (if given) replacing them."""
        if path is None:
            return cls()
        values = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown cost model keys {unknown}; known: {sorted(known)}")
        return cls(**{k: float(v) for k, v in values.items()})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def sample_cost(self, stats: "SampleStats") -> np.ndarray:
        n = stats.tokens.astype(np.float64)
        return (self.sample + self.token * n + self.token_sq * n * n
                + self.patch * stats.patches.astype(np.float64) + self.patch_sq * stats.patch_sq.astype(np.float64))

    def micro_batch_cost(self, members: Sequence[int], stats: "SampleStats", *, packing: bool) -> float:
        """Seconds of one micro-batch of the samples `members` as the rows spend them: packed (one row, attention
        per sample) or padded (every row at the longest length, attention over the padded rows)."""
        members = list(members)
        n = stats.tokens[members].astype(np.float64)
        vision = self.patch * float(stats.patches[members].sum()) + self.patch_sq * float(stats.patch_sq[members].sum())
        if packing:
            text = self.token * n.sum() + self.token_sq * float((n * n).sum())
        else:
            text = len(n) * (self.token * n.max() + self.token_sq * n.max() ** 2)
        return float(self.micro_batch + self.sample * len(n) + text + vision)

    def vision_tokens(self, stats: "SampleStats") -> np.ndarray:
        """The vision encoder's work of every sample in language-token equivalents (what the budget counts)."""
        work = self.patch * stats.patches.astype(np.float64) + self.patch_sq * stats.patch_sq.astype(np.float64)
        return work / self.token


@dataclass(frozen=True, slots=True)
class SampleStats:
    """Per-sample statistics the planner needs, all known after preprocessing (no pixels)."""

    tokens: np.ndarray
    """Language tokens (image tokens included) of every sample."""
    patches: np.ndarray
    """Vision patches of every sample (0 for a text-only row)."""
    patch_sq: np.ndarray
    """Σ over the sample's vision attention blocks of patches² (images, video frame groups)."""

    @classmethod
    def text_only(cls, tokens: Sequence[int] | np.ndarray) -> "SampleStats":
        tokens = np.asarray(tokens, dtype=np.int64)
        return cls(tokens, np.zeros_like(tokens), np.zeros_like(tokens))


def grid_blocks(grid: Sequence[int]) -> tuple[int, int]:
    """(patches per attention block, number of blocks) of an image or video grid: `(rows, cols)` is one block
    (Pixtral); `(t, h, w, ...)` is `t` blocks of `h·w` (Qwen-VL images, `t = 1`, and videos)."""
    if len(grid) == 2:
        return int(grid[0]) * int(grid[1]), 1
    return int(grid[1]) * int(grid[2]), int(grid[0])


def sample_stats(lengths: Sequence[int], grids: Sequence[Sequence[Sequence[int]]] | None = None) -> SampleStats:
    """`SampleStats` from token counts and, per sample, the grids of its images and videos (None: text only)."""
    tokens = np.asarray(lengths, dtype=np.int64)
    if grids is None:
        return SampleStats.text_only(tokens)
    patches = np.zeros(len(tokens), dtype=np.int64)
    patch_sq = np.zeros(len(tokens), dtype=np.int64)
    for i, sample_grids in enumerate(grids):
        for grid in sample_grids:
            block, count = grid_blocks(grid)
            patches[i] += block * count
            patch_sq[i] += block * block * count
    return SampleStats(tokens, patches, patch_sq)


def filler_index(index: int) -> int:
    """The row entry of a filler: sample `index` run with every label masked."""
    return -1 - index


def is_filler(entry: int) -> bool:
    return entry < 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: `ranks[r]` is rank r's micro-batches, each a tuple of rows, each a tuple of sample indices
    (a negative entry is a filler, `filler_index`)."""

    ranks: list[list[tuple[tuple[int, ...], ...]]]
    rank_costs: list[float]
    """The cost model's seconds of every rank's micro-batches (`CostModel.micro_batch_cost`: padding, fillers and
    the per-micro-batch cost included)."""
    num_tokens: int
    """Tokens of the step's samples."""
    num_padded: int
    """Tokens the rows occupy (padding included, before any multiple of `pad_to_multiple_of`)."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0])

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' planned costs."""
        mean = sum(self.rank_costs) / len(self.rank_costs)
        return float(max(self.rank_costs) / mean) if mean > 0 else 1.0


def _lpt(indices: list[int], costs: np.ndarray, num_ranks: int, capacity: int | None) -> list[list[int]]:
    """Heaviest first to the least-loaded rank (ties: lower rank); `capacity` caps samples per rank."""
    order = sorted(indices, key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(num_ranks)]
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, r = heapq.heappop(heap)
        while capacity is not None and len(out[r]) >= capacity:  # a full rank leaves the heap for good
            load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + float(costs[i]), r))
    return out


def _micro_batch_load(members: list[int], tokens: np.ndarray, vision: np.ndarray, packing: bool) -> float:
    text = sum(int(tokens[i]) for i in members) if packing else len(members) * max(int(tokens[i]) for i in members)
    return text + sum(float(vision[i]) for i in members)


def fill_budget(members: list[int], tokens: np.ndarray, vision: np.ndarray, budget: int, packing: bool,
          first_fit: bool) -> list[list[int]]:
    """Samples into micro-batches of at most `budget` tokens as the rows spend them (`packing`: summed; else rows ×
    the longest) plus their vision token equivalents, a sample heavier than `budget` alone; in order (`first_fit`:
    into any open micro-batch that fits, else only the last: contiguous runs of `members`). Also GRPO's token
    budget over its generated sequences (`mmfsdp.train.grpo_sampling.budget_chunks`)."""
    bins: list[list[int]] = []
    for i in members:
        targets = bins if first_fit else bins[-1:]
        for b in targets:
            if _micro_batch_load(b + [i], tokens, vision, packing) <= budget:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


def _split_to(bins: list[list[int]], count: int, tokens: np.ndarray) -> list[list[int]]:
    """Split the micro-batches with the most samples until there are `count` (or every one holds one sample)."""
    bins = [list(b) for b in bins]
    while bins and len(bins) < count:
        widest = max(range(len(bins)), key=lambda k: (len(bins[k]), -k))
        b = bins[widest]
        if len(b) < 2:
            break
        # by length, so each half keeps similar lengths together
        b = sorted(b, key=lambda i: (-int(tokens[i]), i))
        half = len(b) // 2
        bins[widest:widest + 1] = [b[:half], b[half:]]
    return bins


def plan_step(
    indices: Sequence[int],
    stats: SampleStats,
    *,
    dp_size: int,
    micro_batch_size: int,
    micro_batch_tokens: int | None,
    balance: bool,
    packing: bool,
    cost_model: CostModel,
) -> StepPlan:
    """The micro-batches of every rank for the step made of the samples `indices` (module docstring). Balanced, their
    number need not divide over the ranks (GRPO's kept completions, `mmfsdp.train.grpo_sampling`): without a budget
    a rank then takes at most ⌈groups / dp_size⌉ of the `micro_batch_size` groups, and fillers even out the rest."""
    indices = [int(i) for i in indices]
    assert micro_batch_tokens is not None or not packing, "packing plans steps only with a token budget"
    assert balance or len(indices) % dp_size == 0, f"{len(indices)} samples do not split over {dp_size} ranks"
    per_rank = len(indices) // dp_size
    costs = cost_model.sample_cost(stats)
    tokens = stats.tokens
    if micro_batch_tokens is None and balance:
        # fixed micro-batches: group similar lengths (little padding), then give each rank as many groups as
        # it would have had, heaviest group first to the least-loaded rank
        ordered = sorted(indices, key=lambda i: (-int(tokens[i]), i))
        groups = [ordered[k:k + micro_batch_size] for k in range(0, len(ordered), micro_batch_size)]
        group_costs = np.array([cost_model.micro_batch_cost(g, stats, packing=False) for g in groups])
        assigned = _lpt(list(range(len(groups))), group_costs, dp_size, -(-len(groups) // dp_size))
        bins_per_rank = [[groups[g] for g in sorted(a)] for a in assigned]
        shares = [[i for g in bins for i in g] for bins in bins_per_rank]
    elif micro_batch_tokens is None:
        shares = [indices[r * per_rank:(r + 1) * per_rank] for r in range(dp_size)]
        bins_per_rank = [[s[k:k + micro_batch_size] for k in range(0, len(s), micro_batch_size)] for s in shares]
    else:
        vision = cost_model.vision_tokens(stats)
        if balance:
            shares = _lpt(indices, costs, dp_size, None)
            shares = [sorted(s, key=lambda i: (-int(tokens[i]) - float(vision[i]), i)) for s in shares]
        else:
            shares = [indices[r * per_rank:(r + 1) * per_rank] for r in range(dp_size)]
        bins_per_rank = [fill_budget(s, tokens, vision, micro_batch_tokens, packing, first_fit=balance) for s in shares]
    count = max(len(b) for b in bins_per_rank)
    ranks: list[list[tuple[tuple[int, ...], ...]]] = []
    rank_costs: list[float] = []
    num_padded = 0
    for share, bins in zip(shares, bins_per_rank):
        bins = _split_to(bins, count, tokens)
        lightest = min(share, key=lambda i: (costs[i], i)) if share else min(indices, key=lambda i: (costs[i], i))
        cost = 0.0
        micro_batches: list[tuple[tuple[int, ...], ...]] = []
        for b in bins:
            cost += cost_model.micro_batch_cost(b, stats, packing=packing)
            if packing:
                micro_batches.append((tuple(b),))
                num_padded += sum(int(tokens[i]) for i in b)
            else:
                micro_batches.append(tuple((i,) for i in b))
                num_padded += len(b) * max(int(tokens[i]) for i in b)
        for _ in range(count - len(bins)):
            micro_batches.append(((filler_index(lightest),),))
            cost += cost_model.micro_batch_cost([lightest], stats, packing=packing)
            num_padded += int(tokens[lightest])
        ranks.append(micro_batches)
        rank_costs.append(cost)
    return StepPlan(ranks, rank_costs, int(sum(int(tokens[i]) for i in indices)), num_padded)


def describe(plan: StepPlan) -> dict[str, Any]:
    """Plain numbers of a plan, for logs and benchmarks."""
    padded = plan.num_padded
    return {
        "micro_batches": plan.num_micro_batches,
        "imbalance": plan.imbalance,
        "padding_fraction": (padded - plan.num_tokens) / padded if padded else 0.0,
    }
