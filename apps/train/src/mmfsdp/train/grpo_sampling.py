"""The generation side of a `stage: grpo` step (`mmfsdp.train.grpo` runs it): what a round and a generation batch
hold (`Round`, `Generation`), the table every data-parallel rank's numbers are gathered into (`gather_columns`), the
completions log (`write_completions`), and DAPO's dynamic sampling (`training.grpo.dynamic_sampling`): which groups a
step trains on, and how a rank's kept completions fill its training micro-batches (pure functions).

A group whose rewards are all equal has zero advantages and trains nothing: DAPO drops it and samples more prompts.
With dynamic sampling a step generates in rounds (`sample_rounds`):

1. round 1 is the step's prompts from the loader; their number over all data-parallel ranks is the step's target
   N of groups;
2. every round, each rank generates and scores its prompts and the per-group "rewards vary" flags of every rank are
   gathered (`GRPOObjective._gather`'s table), so every rank sees the same global list of groups;
3. while fewer than N groups vary and rounds remain (1 + `max_resample_rounds`), every rank draws the loader's next
   step of prompts and makes another round: the decision comes from the gathered flags, so all ranks make the same
   rounds and the same collectives, also a rank whose groups are all dropped;
4. the first N varying groups in the global order are kept (`keep_first_varying`); after the last round with fewer
   found, all of them (the step trains on what it found: `rollout/groups_kept` says so).

The global order is the same on every layout (1 process, FSDP2, Ulysses, Ring): rounds in the order they were
generated; within a round, a pseudo-random order of the prompts keyed by (seed, generation index, dataset index)
(`round_order`). Not the ranks' concatenation, which depends on the layout; and not the dataset index itself, which
would keep the first rows of the file whenever a round finds more varying groups than still needed (a file sorted by
difficulty would train its easy prompts). A prompt that occurs twice in a round (an epoch's end) gives the same
completions twice; the rank and position then break the tie between two equal groups.

Each rank keeps the kept groups of its own prompts: nothing moves between ranks. So the ranks hold different numbers
of groups, while FSDP2 needs the same number of forwards on each: every rank runs M = the most micro-batches any rank
needs at `micro_batch_size` groups each (at least 1; `micro_batch_count`) and splits its kept completions evenly over
them (`split_evenly`; a group may span two micro-batches: advantages and normalisers are global). A micro-batch left
empty (a rank with fewer completions than M, or none) runs a filler: one of the rank's generated completions with no
trained token, which makes the forward and backward collectives and adds exactly zero to the loss and the gradients.

A token budget (`training.micro_batch_tokens`) replaces `micro_batch_size` as what fills a training micro-batch, as
in SFT (docs/data.md, "Token budget and balance"): the loader hands whole prompts, and after generation each rank
cuts its kept sequences (prompt + completion, in order) into contiguous micro-batches of at most the budget tokens
as the rows spend them, plus the prompts' vision work in token equivalents, a sequence heavier than the budget alone
(`budget_chunks`, `mmfsdp.data.balance.fill_budget`); the ranks' counts are gathered, every rank runs the largest
(M), a rank with fewer splits its widest micro-batches in two until it has M, and fillers make up the rest
(`equal_chunks`). Advantages and normalisers are over the step's sequences, so the loss is the run's without a
budget, except `bnpo`'s (a mean of micro-batch means: refused with a budget).

Balanced steps (`data.dataloader_param.balance`, as SFT's): the kept completions move between ranks. Every rank
gathers every kept completion's tokens and sampling log-probs (a float64 table of 2 × `max_completion_length` rows,
a few KB a completion), plans the step's kept sequences over the ranks by the cost model (`balanced_layout`: LPT,
heaviest first to the least-loaded rank; `micro_batch_size` × `num_generations` sequences or the token budget a
micro-batch), and takes its share: a prompt it did not generate from is read again from the dataset by its index
(the same tokens and pixels; no pixels cross ranks). Advantages and normalisers are the step's, so the loss is the
run's without balance, except `bnpo`'s (refused, as with a budget).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from mmfsdp.data.balance import CostModel, SampleStats, fill_budget, is_filler, plan_step

__all__ = [
    "BalancedLayout", "Generation", "KeptLayout", "Round", "Selection", "balanced_layout", "balanced_share",
    "budget_chunks",
    "equal_chunks", "gather_columns", "group_owners", "keep_first_varying", "kept_layout", "micro_batch_count",
    "round_order", "sample_rounds", "split_evenly", "write_completions",
]


def round_order(seed: int, generation: int, prompt_index: int) -> int:
    """A prompt's place within a round of the global order: a hash of (seed, generation index, dataset index), the
    same on every rank and layout."""
    digest = hashlib.blake2b(f"{seed}:{generation}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def keep_first_varying(keys: Sequence[tuple], varies: torch.Tensor, target: int) -> torch.Tensor:
    """bool `[n]`: the first `target` groups whose rewards vary, in the order of `keys` (one sortable, distinct key per
    group); fewer when fewer vary."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    kept = torch.zeros(len(keys), dtype=torch.bool)
    kept[[i for i in order if varies[i]][:target]] = True
    return kept


@dataclass(frozen=True, slots=True)
class Selection:
    """The groups of a step's rounds that train."""

    kept: torch.Tensor
    """bool `[groups of all rounds]`, in the rounds' order and each round's gathered order."""
    rounds: int
    """Generation rounds made."""
    target: int
    """N: the groups of round 1."""

    @property
    def found(self) -> int:
        return int(self.kept.sum())


def sample_rounds(next_round: Callable[[int], tuple[list[tuple], torch.Tensor]], *, max_rounds: int) -> Selection:
    """Steps 1-4 of the module docstring. `next_round(r)` makes round r (from 0) on every rank and returns its groups'
    global keys and "rewards vary" flags, in its gathered order; rounds stop once N groups vary or after
    `max_rounds`."""
    keys: list[tuple] = []
    flags: list[torch.Tensor] = []
    for rounds in range(1, max_rounds + 1):
        new_keys, varies = next_round(rounds - 1)
        if rounds == 1:
            target = len(new_keys)
        keys += new_keys
        flags.append(varies.bool())
        if int(torch.cat(flags).sum()) >= target:
            break
    return Selection(keep_first_varying(keys, torch.cat(flags), target), rounds, target)


def micro_batch_count(kept_per_rank: Sequence[int], micro_batch_size: int) -> int:
    """M: the training micro-batches of every rank, enough for the rank with the most kept groups at
    `micro_batch_size` groups each; at least 1."""
    return max([1, *(math.ceil(k / micro_batch_size) for k in kept_per_rank)])


def split_evenly(count: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous chunks of `count` items, differing by at most one (the larger first)."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def budget_chunks(tokens: Sequence[int], vision: Sequence[float], budget: int, *, packing: bool) -> list[int]:
    """Sizes of the contiguous micro-batches that hold sequences of `tokens` tokens and `vision` vision token
    equivalents, in order, within `budget` (module docstring; packed rows sum their tokens, padded ones pay rows ×
    the longest)."""
    bins = fill_budget(list(range(len(tokens))), np.asarray(tokens, dtype=np.int64),
                       np.asarray(vision, dtype=np.float64), budget, packing, first_fit=False)
    return [len(b) for b in bins]


def equal_chunks(chunks: Sequence[int], count: int) -> list[int]:
    """`chunks` made `count` long (≥ `len(chunks)`): the chunk with the most sequences (the first of equals) split
    into two contiguous halves (the larger first) while one holds two or more, then empty chunks (fillers)."""
    chunks = [c for c in chunks if c]
    while len(chunks) < count:
        widest = max(range(len(chunks)), key=lambda k: (chunks[k], -k), default=None)
        if widest is None or chunks[widest] < 2:
            break
        size = chunks[widest]
        chunks[widest : widest + 1] = [size - size // 2, size // 2]
    return chunks + [0] * (count - len(chunks))


@dataclass(frozen=True, slots=True)
class BalancedLayout:
    """This rank's training micro-batches of a balanced step (`balanced_layout`)."""

    positions: list[int]
    """The kept completions it trains (entries of the step's kept columns), micro-batch by micro-batch."""
    chunks: list[int]
    """How many of `positions` each micro-batch takes, in order; 0 = a filler."""
    num_batches: int
    """Micro-batches that hold completions, over the data-parallel ranks."""
    imbalance: float
    """The plan's max / mean of the ranks' costs."""


def balanced_layout(tokens: np.ndarray, patches: np.ndarray, patch_sq: np.ndarray, *, dp_size: int, dp_rank: int,
                    micro_batch_size: int, budget: int | None, packing: bool, cost_model: CostModel) -> BalancedLayout:
    """Balanced steps (`data.dataloader_param.balance`): the step's kept completions (each of `tokens` prompt +
    completion tokens and its prompt's vision patches) planned over the data-parallel ranks as SFT plans a step's
    samples (`mmfsdp.data.balance.plan_step`, balance on): LPT on the cost model, `micro_batch_size` sequences or the
    budget a micro-batch, the same number of micro-batches on every rank, fillers where a rank is short. A pure
    function of the gathered numbers: every rank computes the same plan."""
    if not len(tokens):
        return BalancedLayout([], [0], 0, 1.0)
    plan = plan_step(range(len(tokens)), SampleStats(np.asarray(tokens, dtype=np.int64), np.asarray(patches),
                                                     np.asarray(patch_sq)),
                     dp_size=dp_size, micro_batch_size=micro_batch_size, micro_batch_tokens=budget, balance=True,
                     packing=packing and budget is not None, cost_model=cost_model)
    members = [[[i for row in mb for i in row if not is_filler(i)] for mb in rank] for rank in plan.ranks]
    mine = members[dp_rank]
    return BalancedLayout([i for mb in mine for i in mb], [len(mb) for mb in mine],
                          sum(bool(mb) for rank in members for mb in rank), plan.imbalance)


def balanced_share(table: torch.Tensor, columns: torch.Tensor, prompts: list[dict[str, Any]], rollouts: list[Any], *,
                   prompt_stats: SampleStats, read: Callable[[int], dict[str, Any]], dims: Any, device: torch.device,
                   micro_batch_size: int, budget: int | None, packing: bool, cost_model: CostModel,
                   width: int) -> tuple[list[dict[str, Any]], list[list[int]], list[torch.Tensor], dict[str, Any]]:
    """A balanced step: this rank's share of every rank's kept completions (the `columns` of the rounds' `table`) by
    `balanced_layout` — its prompts (its own `prompts`, or `read(prompt index)` from the dataset for one generated
    on another rank), their completions and sampling log-probs (all-gathered from every rank's kept `rollouts`,
    `width` = `max_completion_length` tokens each) — and the `Generation` fields that say where they are."""
    width = max(1, width)
    kept = table[:, columns]
    index, lengths = kept[-1].long().numpy(), kept[kept.shape[0] - 3].long().numpy()
    plan = balanced_layout(prompt_stats.tokens[index] + lengths, prompt_stats.patches[index],
                           prompt_stats.patch_sq[index], dp_size=dims.dp_size, dp_rank=dims.dp_rank,
                           micro_batch_size=micro_batch_size, budget=budget, packing=packing, cost_model=cost_model)
    local = torch.zeros(2 * width, len(rollouts), dtype=torch.float64)  # tokens, then log-probs (exact in float64)
    for k, rollout in enumerate(rollouts):
        n = len(rollout.completion_ids)
        local[:n, k] = torch.tensor(rollout.completion_ids, dtype=torch.float64)
        local[width : width + n, k] = torch.tensor(rollout.logprobs, dtype=torch.float64)
    every, _ = gather_columns(local, dims, device)  # in the order of `columns`: rank by rank, round, position
    items = {int(item["prompt_index"]): item for item in prompts}
    order: dict[int, int] = {}
    owners, completions, engine_logps = [], [], []
    for position in plan.positions:
        prompt, n = int(index[position]), int(lengths[position])
        if prompt not in items:  # generated on another rank: the same item again, from the dataset
            items[prompt] = read(prompt)
            if "bad_reason" in items[prompt]:
                raise RuntimeError(f"prompt {prompt}, read again for a balanced step, could not be decoded: "
                                   f"{items[prompt]['bad_reason']}: {items[prompt].get('bad_detail')}")
        owners.append(order.setdefault(prompt, len(order)))
        completions.append([int(t) for t in every[:n, position]])
        engine_logps.append(every[width : width + n, position].float())
    fields = {"positions": plan.positions, "owners": owners, "planned_imbalance": plan.imbalance,
              "chunks": plan.chunks, "num_batches": plan.num_batches}
    return [items[prompt] for prompt in order], completions, engine_logps, fields


def group_owners(offsets: Sequence[int], num_generations: int) -> list[tuple[int, int]]:
    """(data-parallel rank, position among its prompts) of each group of a gathered table in which rank r holds the
    columns `offsets[r]:offsets[r + 1]`."""
    return [(rank, position) for rank in range(len(offsets) - 1)
            for position in range((offsets[rank + 1] - offsets[rank]) // num_generations)]


@dataclass(frozen=True, slots=True)
class KeptLayout:
    """Where the kept groups of a step are."""

    groups: list[tuple[int, int]]
    """This rank's kept groups: (round, position among its prompts of the round), in that order."""
    columns: torch.Tensor
    """int64: the kept completions' columns of the rounds' tables side by side, rank by rank, then by round and
    position (this rank's from `offset`)."""
    offset: int
    per_rank: list[int]
    """Kept groups of each data-parallel rank."""


def kept_layout(owners: Sequence[Sequence[tuple[int, int]]], kept: torch.Tensor, *, num_generations: int,
                dp_size: int, dp_rank: int) -> KeptLayout:
    """`owners[r]`: `group_owners` of round r's table; `kept`: a flag per group of all rounds, in the same order."""
    groups = [(rank, r, position) for r, round_owners in enumerate(owners) for rank, position in round_owners]
    entries = sorted((*group, i) for i, group in enumerate(groups) if kept[i])
    columns = torch.tensor([i * num_generations + g for *_, i in entries for g in range(num_generations)],
                           dtype=torch.int64)
    per_rank = [sum(rank == q for rank, *_ in entries) for q in range(dp_size)]
    mine = [(r, position) for rank, r, position, _ in entries if rank == dp_rank]
    return KeptLayout(mine, columns, sum(per_rank[:dp_rank]) * num_generations, per_rank)


@dataclass(slots=True)
class Round:
    """One round of generation (one without dynamic sampling): this rank's prompts, completions and rewards, and the
    gathered table of every rank's."""

    prompts: list[dict[str, Any]]
    """The loader's prompt items, in order."""
    rollouts: list[Any]
    """Their `Rollout`s, prompt by prompt, generation by generation."""
    texts: list[str]
    totals: torch.Tensor
    per_function: torch.Tensor
    table: torch.Tensor
    """float64 `[4 + F, N]` of every rank's completions (`gather_columns`): reward totals, each function's rewards,
    lengths, truncation flags, the prompt's dataset index."""
    owners: list[tuple[int, int]]
    """(data-parallel rank, position among its prompts) of each group of `table`."""


@dataclass(slots=True)
class Generation:
    """One generation batch, trained on for `num_iterations` steps: what the training micro-batches are built from
    (`mmfsdp.train.grpo.GRPOObjective._build`) and what a checkpoint taken before its last step keeps
    (`GRPOObjective.state_dict`)."""

    number: int
    """The rollout's key: the generation index (step - 1) // num_iterations + 1 (the step when num_iterations is 1)."""
    prompts: list[dict[str, Any]]
    """This rank's prompt items whose groups train, in order (all of them without dynamic sampling)."""
    completions: list[list[int]]
    """Their completions, prompt by prompt, generation by generation."""
    engine_logps: list[torch.Tensor]
    """The engine's sampling log-prob of each completion's tokens (fp32, CPU)."""
    chunks: list[int]
    """This rank's training micro-batches: how many of `completions` each takes, in order; 0 = a filler."""
    filler: dict[str, Any] | None
    """What a filler micro-batch runs (`prompt` item, `completion` ids: this rank's first, training nothing); None
    when there is none."""
    table: torch.Tensor
    """float64 `[4 + F, N]` of every rank's completions of every round (`Round.table`): the statistics'."""
    columns: torch.Tensor
    """int64: the columns of `table` that train, rank by rank (all, in order, without dynamic sampling)."""
    offset: int
    """This rank's first entry of `columns`: its own kept completions (the completions log's)."""
    num_batches: int
    """Training micro-batches that hold completions, over the data-parallel ranks (`bnpo`'s normaliser)."""
    rounds: int
    """Generation rounds made."""
    old_logps: list[torch.Tensor | None]
    """Per micro-batch, the policy's log-probs `[n, T]` on the weights that generated the batch: the first iteration's
    own (detached), the old policy of the later ones (`num_iterations > 1` only)."""
    ref_logps: list[torch.Tensor | None]
    """Per micro-batch, the reference's log-probs `[n, T]` (β > 0), computed by the first iteration (`num_iterations
    > 1` only: the reference does not change)."""
    diff_max: torch.Tensor
    """This rank's `rollout/logprob_diff_max` of the first iteration (device scalar)."""
    diff_sum: torch.Tensor
    """The sum of this rank's |engine − trainer| log-prob gaps of the first iteration (`rollout/logprob_diff_mean`:
    over the generation's trained tokens; device scalar)."""
    positions: list[int] | None = None
    """Balanced steps (`balanced_layout`): the entry of `columns` of each of `completions`; None: this rank's own,
    `offset` on."""
    owners: list[int] | None = None
    """Balanced steps: the entry of `prompts` of each of `completions`; None: completion k's is k // num_generations."""
    planned_imbalance: float | None = None
    """Balanced steps: the plan's max / mean of the ranks' costs."""


def gather_columns(local: torch.Tensor, dims: Any, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Every data-parallel rank's columns `[K, n_r]` of a float64 table, in rank order (on the host), and where each
    rank's begin (the offsets `[0, n_0, n_0 + n_1, ..., N]`). A collective of the data-parallel group."""
    if dims.dp_size == 1:
        return local, [0, local.shape[1]]
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dims.dp_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]], device=device), group=dims.dp_group)
    sizes_h = [int(s) for s in torch.cat(sizes).tolist()]
    padded = torch.zeros(local.shape[0], max(sizes_h), dtype=local.dtype, device=device)
    padded[:, : local.shape[1]] = local.to(device)
    parts = [torch.zeros_like(padded) for _ in sizes_h]
    dist.all_gather(parts, padded, group=dims.dp_group)
    table = torch.cat([part[:, :n] for part, n in zip(parts, sizes_h)], dim=1).cpu()
    return table, [0, *itertools.accumulate(sizes_h)]


def write_completions(path: Path, step: int, rounds: list[Round], groups: list[tuple[int, int]],
                      advantages: torch.Tensor, reward_names: list[str], *, num_generations: int,
                      dynamic: bool) -> None:
    """Appends this rank's completions of every round to `path` (the completions log) with their rewards, and the
    advantages of those that train (`groups`, `advantages`: this rank's kept groups and their completions'; null for
    a dropped group); with dynamic sampling each row says its round and whether it was kept."""
    G, kept = num_generations, {group: k for k, group in enumerate(groups)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r, rnd in enumerate(rounds):
            for k, text in enumerate(rnd.texts):
                item, place = rnd.prompts[k // G], kept.get((r, k // G))
                row = {
                    "step": step, "prompt_index": item["prompt_index"], "prompt": item["prompt_text"],
                    "completion": text, "solution": item["solution"], "reward": float(rnd.totals[k]),
                    **{f"rewards/{name}": float(rnd.per_function[f, k]) for f, name in enumerate(reward_names)},
                    "advantage": None if place is None else float(advantages[place * G + k % G]),
                }
                if dynamic:
                    row.update(round=r + 1, kept=place is not None)
                f.write(json.dumps(row) + "\n")
