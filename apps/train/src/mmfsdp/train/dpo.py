"""`stage: dpo`: preference training on chosen / rejected pairs, an objective of `mmfsdp.train.objective`.

`PreferenceObjective` computes a preference loss on per-sequence log-probabilities (`mmfsdp.model.preference`,
TRL's definitions). The forward returns the summed cross-entropy of each sequence of the micro-batch (chosen_0,
rejected_0, chosen_1, ...), whole on every CP rank; the reference's log-probabilities of the same sequences come
from a reference, chosen by one rule (`PreferenceObjective.reference_kind`): `PrecomputedReference`
(`training.dpo.precompute_ref_logps`, computed once before the first step and saved to
`<output_dir>/ref_logps.safetensors`), else `LoraReference` (the policy with its adapters switched off), else
`FrozenReference` (a frozen copy of the initial model sharded like the policy; the live references and their rule
are `mmfsdp.train.references`, shared with GRPO). `PairRewards` are its held-out metrics. The module docstring of `mmfsdp.train.objective` says how a stage's objective is called.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError, get_logger
from mmfsdp.model import model_inputs, shift_labels
from mmfsdp.model.loss import IGNORE_INDEX, sample_ids, segment_sum, sequence_cross_entropy
from mmfsdp.model.preference import PAIR_STATS, pair_losses, pair_objective
from mmfsdp.train.objective import MemoryTerm, Objective, ObjectiveContext
from mmfsdp.train.references import (
    LIVE_REFERENCES,
    FrozenReference,
    LoraReference,
    ReferenceKind,
    adapters_disabled,
    frozen_copy_bytes,
    live_reference_kind,
    sequence_logps,
)

__all__ = [
    "PreferenceObjective",
    "PairRewards",
    "LoraReference",
    "FrozenReference",
    "PrecomputedReference",
    "adapters_disabled",
    "precompute_reference",
    "REF_LOGPS_FILE",
]

log = get_logger("mmfsdp.train")

REF_LOGPS_FILE = "ref_logps.safetensors"


# -- the reference's log-probabilities ---------------------------------------------------------------------------


def pairs_with_targets(counts: torch.Tensor) -> torch.Tensor:
    """bool `[P]` from the sequences' trained-token counts `[2P]`: the real pairs. A token-budget step pads its
    micro-batches with filler pairs whose labels are all -100 (`pair_index`: the pair they copy); they count
    nowhere."""
    return (counts[0::2] + counts[1::2]) > 0


class PrecomputedReference:
    """The initial model's log-probabilities of every pair of a split, `[num_pairs, 2]`, looked up by pair index;
    `splits` holds the training split's (`train`) and, when the run evaluates, the evaluation split's (`eval`)."""

    def __init__(self, splits: dict[str, tuple[torch.Tensor, torch.Tensor]], split: str = "train"):
        self.splits = splits
        self.split = split
        self.table, self.known = splits[split]

    def for_split(self, split: str) -> PrecomputedReference:
        return PrecomputedReference(self.splits, split)

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> PrecomputedReference:
        """Read from `<output_dir>/ref_logps.safetensors`, or computed now by the initial model (a fresh start
        only) and saved there."""
        path = cls.path(ctx.output_dir)
        num_pairs = len(ctx.train_dataset)
        evaluates = ctx.evaluator.evaluates()
        sizes = {"train": num_pairs, **({"eval": len(ctx.evaluator.dataset)} if evaluates else {})}
        if path.is_file():
            log.info(f"reference log-probabilities from {path}")
            return cls.load(path, sizes)
        if ctx.step > 0:
            raise ConfigError(
                "training.dpo.precompute_ref_logps",
                f"the run resumes at step {ctx.step} but {path} is missing; the reference (the initial model) is "
                "gone. Restore the file, or start the run again from its initial weights",
            )
        t = ctx.cfg.training
        started = time.perf_counter()
        log.info(f"precomputing the reference's log-probabilities of the pairs of {t.train_iters} steps")
        loader = ctx.fresh_loader()
        reference = precompute_reference(
            ctx.model, loader, steps=t.train_iters, num_micro_batches=t.gradient_accumulation_steps,
            num_pairs=num_pairs, dims=ctx.dims, device=ctx.device, to_device=ctx.to_device,
            eval_batches=ctx.evaluator.batches() if evaluates else None, num_eval_pairs=sizes.get("eval", 0),
        )
        loader.close()
        if ctx.rank == 0:
            reference.save(path)
        dist.barrier()
        log.info(f"reference log-probabilities of {int(reference.known.sum())} pairs in "
                 f"{time.perf_counter() - started:.1f}s -> {path}")
        return reference

    def logps(self, inputs: dict[str, Any], seq: dict[str, Any], pair_index: torch.Tensor) -> torch.Tensor:
        index = pair_index.to(torch.int64).cpu()
        if not bool(self.known[index].all()):
            missing = index[~self.known[index]].tolist()
            raise RuntimeError(
                f"{self.split} pairs {missing[:5]} have no precomputed reference log-probabilities ({REF_LOGPS_FILE})"
            )
        return self.table[index].reshape(-1).to(seq["shift_labels"].device)

    @staticmethod
    def path(output_dir: Path) -> Path:
        return Path(output_dir) / REF_LOGPS_FILE

    @classmethod
    def load(cls, path: Path, sizes: dict[str, int]) -> PrecomputedReference:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        splits = {}
        for split, num_pairs in sizes.items():
            table = tensors.get(f"{split}.ref_logps")
            if table is None or table.shape != (num_pairs, 2):
                found = "none" if table is None else table.shape[0]
                raise ConfigError(
                    "training.dpo.precompute_ref_logps",
                    f"{path} holds reference log-probabilities of {found} {split} pairs, the dataset has {num_pairs}; "
                    "delete it to compute them again (only at the start of a run: the reference is the initial model)",
                )
            splits[split] = (table, tensors[f"{split}.known"].bool())
        return cls(splits)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for split, (table, known) in self.splits.items():
            tensors[f"{split}.ref_logps"] = table.contiguous()
            tensors[f"{split}.known"] = known.to(torch.uint8)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)


class _PairTable:
    """Reference log-probabilities gathered pair by pair on each rank, then merged over the data-parallel group."""

    def __init__(self, num_pairs: int):
        self.table = torch.zeros(num_pairs, 2, dtype=torch.float32)
        self.known = torch.zeros(num_pairs, dtype=torch.bool)

    def missing(self, pair_index: torch.Tensor) -> bool:
        return not bool(self.known[pair_index.to(torch.int64)].all())  # a filler's pair is known once it is seen

    def add(self, pair_index: torch.Tensor, logps: torch.Tensor, valid: torch.Tensor) -> None:
        index = pair_index.to(torch.int64)[valid]
        logps = logps.cpu().reshape(-1, 2)[valid]
        fresh = ~self.known[index]
        self.table[index[fresh]] = logps[fresh]
        self.known[index] = True

    def merged(self, dims, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A pair computed by several data-parallel ranks keeps the mean of their (equal up to layout) values."""
        if dims.dp_size == 1:
            return self.table, self.known
        sums = (self.table * self.known[:, None]).to(device)
        counts = self.known.to(torch.float32).to(device)
        dist.all_reduce(sums, group=dims.dp_group)
        dist.all_reduce(counts, group=dims.dp_group)
        sums, counts = sums.cpu(), counts.cpu()
        known = counts > 0
        return torch.where(known[:, None], sums / counts.clamp(min=1)[:, None], 0.0), known


# -- the preference objective -------------------------------------------------------------------------------------

REFERENCES: dict[str, Any] = {"precomputed": PrecomputedReference, **LIVE_REFERENCES}
"""The reference of each kind (`PreferenceObjective.reference_kind`), built by its `build(ctx)`."""


class PreferenceObjective(Objective):
    """`stage: dpo` (module docstring)."""

    stage = "dpo"
    sequences_per_sample = 2
    """`micro_batch_size` counts pairs: a chosen and a rejected sequence each."""

    @staticmethod
    def reference_kind(training) -> ReferenceKind:
        """Which reference a run of the `training` section has (the one rule): the precomputed log-probabilities
        when `dpo.precompute_ref_logps` asks, else the live reference (`mmfsdp.train.references.live_reference_kind`)."""
        if training.dpo.precompute_ref_logps:
            return "precomputed"
        return live_reference_kind(training)

    @classmethod
    def configure(cls, cfg) -> None:
        # a DPO run reads pairs: its rows are preference rows (a row without a rejected answer is a bad row)
        cfg.data.dataset_param.attr.ranking = True

    @classmethod
    def check_config(cls, cfg) -> None:
        t = cfg.training
        if cls.reference_kind(t) == "lora" and t.lora.pretrained_lora_path:
            raise ConfigError(
                "training.dpo.precompute_ref_logps",
                "a DPO run that continues a trained adapter (training.lora.pretrained_lora_path) needs that adapter in "
                "its reference; with LoRA the live reference is the base model without adapters: set "
                "precompute_ref_logps: true (the initial model, adapter included, computes them once)",
            )

    @classmethod
    def memory_terms(cls, cfg, model: torch.nn.Module, shard_size: int) -> list[MemoryTerm]:
        if cls.reference_kind(cfg.training) != "frozen":
            return []  # the policy's own weights, or a table of numbers
        size = frozen_copy_bytes(cfg, model, shard_size)
        return [MemoryTerm("reference", "DPO reference", size, f"frozen copy, {cfg.model.dtype} / {shard_size}")]

    @classmethod
    def memory_savings(cls, cfg) -> list[tuple[str, Any]]:
        t = cfg.training
        if cls.reference_kind(t) != "frozen":
            return []
        replace = dataclasses.replace
        return [("training.dpo.precompute_ref_logps: true",
                 replace(cfg, training=replace(t, dpo=replace(t.dpo, precompute_ref_logps=True))))]

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> PreferenceObjective:
        if not getattr(ctx.train_dataset, "is_preference", False):
            raise ConfigError(
                "training.stage",
                "dpo needs pairwise data (chosen/rejected answers): set data.dataset_param.attr.ranking: true for a "
                "file of pairs (docs/preference.md lists the formats), or use a preference dataset type",
            )
        reference = REFERENCES[cls.reference_kind(ctx.cfg.training)].build(ctx)
        return cls(ctx.cfg, ctx.dims, ctx.device, reference)

    def __init__(self, cfg, dims, device: torch.device, reference):
        self.dpo = cfg.training.dpo
        self.dims = dims
        self.device = device
        self.reference = reference
        self.cp_share = 1.0 / max(1, dims.cp_size)
        self._plans: list[dict[str, Any]] = []
        self._pairs_global = torch.ones((), device=device)
        self._chosen_tokens_global = torch.ones((), device=device)
        self._stat_sums = torch.zeros(len(PAIR_STATS), dtype=torch.float32, device=device)

    @staticmethod
    def sequences(mb: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """The forward's per-sequence keywords of a preference micro-batch: targets, unit weights on the trained
        tokens, each token's sequence (tokens of trailing padding segments: none) and the sequence count."""
        cu = mb.get("cu_seq_lens")
        pairs = int(mb["pair_index"].numel())
        targets = shift_labels(mb["labels"], cu)
        ids = sample_ids(targets.shape, cu)
        if int(ids.max()) + 1 < 2 * pairs:
            raise RuntimeError(f"a preference micro-batch of {pairs} pairs holds only {int(ids.max()) + 1} sequences")
        ids = torch.where((ids < 2 * pairs) & (targets != IGNORE_INDEX), ids, -1)
        weights = (ids >= 0).to(torch.float32)
        return {
            "shift_labels": targets.to(device),
            "loss_weights": weights.to(device),
            "sequence_ids": ids.to(device),
            "num_sequences": 2 * pairs,
        }

    def start_step(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self._plans = []
        local = torch.zeros(2, dtype=torch.float64)
        for mb in micro_batches:
            seq = self.sequences(mb, torch.device("cpu"))
            counts = segment_sum(seq["loss_weights"].reshape(-1), seq["sequence_ids"], seq["num_sequences"])
            valid = pairs_with_targets(counts)
            local += torch.tensor([float(valid.sum()), float(counts[0::2].sum())], dtype=torch.float64)
            self._plans.append({"seq": {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in seq.items()},
                                "counts": counts.to(self.device), "valid": valid.to(self.device),
                                "pair_index": mb["pair_index"]})
        reduced = local.to(self.device)
        if self.dims.dp_size > 1:
            dist.all_reduce(reduced, group=self.dims.dp_group)
        self._pairs_global, self._chosen_tokens_global = reduced[0].float(), reduced[1].float()
        self._stat_sums = torch.zeros(len(PAIR_STATS), dtype=torch.float32, device=self.device)
        return micro_batches

    def micro_batch(self, model, index: int, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        plan = self._plans[index]
        seq = plan["seq"]
        ref = self.reference.logps(inputs, seq, plan["pair_index"])
        out = model(**inputs, **seq)
        loss, terms = pair_objective(
            out.loss, ref, plan["counts"], num_pairs_global=self._pairs_global,
            num_chosen_tokens_global=self._chosen_tokens_global, loss_type=self.dpo.loss_type, beta=self.dpo.beta,
            label_smoothing=self.dpo.label_smoothing, rpo_alpha=self.dpo.rpo_alpha, valid=plan["valid"],
        )
        self._stat_sums += terms.stats.sum(dim=1) / self._pairs_global.clamp(min=1.0)
        return out, loss * self.cp_share

    def stats(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        sums = self._stat_sums
        reductions = []
        if self.dims.dp_size > 1:
            reductions.append(dist.all_reduce(sums, group=self.dims.dp_group, async_op=True))
        return {name: sums[i] for i, name in enumerate(PAIR_STATS)}, reductions

    def eval_metrics(self) -> PairRewards:
        return PairRewards(self.reference, beta=self.dpo.beta, device=self.device)


class PairRewards:
    """DPO's held-out metrics (`Evaluator.accuracy`): `reward_accuracy`, the share of pairs whose implicit reward
    `β · log π/π_ref` is higher for the chosen answer, and `reward_margin`, its mean margin
    (`mmfsdp.model.preference` computes both), against the run's reference (its evaluation split's values when
    precomputed)."""

    num_sums = 3
    """Per batch: pairs, reward wins, summed margins."""

    def __init__(self, reference, *, beta: float, device: torch.device):
        self.reference = reference
        self.beta = beta
        self.device = device

    def batch(self, batch: dict[str, Any], inputs: dict[str, Any], logits: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
        """float64 `[num_sums]` of an evaluation batch of pairs (padded: a sequence per row), from the policy's
        logits and targets (on the host) and the batch's model `inputs` (on the device, for a live reference)."""
        seq = PreferenceObjective.sequences(batch, self.device)
        trained = (targets != IGNORE_INDEX).float()
        rows = torch.arange(targets.shape[0])[:, None].expand_as(targets)
        ce = sequence_cross_entropy(logits, targets, trained, rows, targets.shape[0])
        ref = self.reference.for_split("eval").logps(inputs, seq, batch["pair_index"]).to(logits.device)
        stats = pair_losses(-ce, ref, trained.sum(dim=1), beta=self.beta).stats
        margins = stats[PAIR_STATS.index("rewards/margins")]
        wins = stats[PAIR_STATS.index("rewards/accuracies")]
        return torch.tensor([margins.numel(), float(wins.sum()), float(margins.sum())], dtype=torch.float64)

    def result(self, sums: list[float]) -> dict[str, float]:
        pairs, wins, margins = sums
        return {"reward_accuracy": wins / max(pairs, 1), "reward_margin": margins / max(pairs, 1),
                "num_pairs": int(pairs)}

    @staticmethod
    def describe(result: dict[str, Any]) -> str:
        return (f"reward accuracy {result['reward_accuracy']:.3f}, mean reward margin {result['reward_margin']:.4g} "
                f"on {result['num_pairs']} held-out pairs")


def _valid_pairs(seq: dict[str, Any]) -> torch.Tensor:
    counts = segment_sum(seq["loss_weights"].reshape(-1), seq["sequence_ids"], seq["num_sequences"])
    return pairs_with_targets(counts).cpu()


def precompute_reference(model, loader, *, steps: int, num_micro_batches: int, num_pairs: int, dims, device,
                         to_device, eval_batches=None, num_eval_pairs: int = 0) -> PrecomputedReference:
    """The initial model's log-probabilities of the pairs of the next `steps` optimizer steps of `loader` (a fresh
    loader in the training loader's state: the same micro-batches the run will train on), on every rank; and of the
    evaluation pairs (`eval_batches`: the evaluator's `(batch, counted)` batches, the same number on every rank).

    A micro-batch whose pairs every rank already has is skipped by all ranks together (one small all-reduce per
    step decides), so a pair seen again in a later epoch costs no forward."""
    train = _PairTable(num_pairs)
    every = max(1, steps // 10)
    for step in range(steps):
        micro_batches = loader.next_step(num_micro_batches)
        todo = torch.tensor([float(train.missing(mb["pair_index"])) for mb in micro_batches], device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(todo, op=dist.ReduceOp.MAX)
        for mb, needed in zip(micro_batches, todo.tolist()):
            if needed:
                seq = PreferenceObjective.sequences(mb, device)
                logps = sequence_logps(model, to_device(model_inputs(mb)), seq)
                train.add(mb["pair_index"], logps, _valid_pairs(seq))
        if (step + 1) % every == 0 or step + 1 == steps:
            log.info(f"reference log-probabilities: step {step + 1}/{steps}, {int(train.known.sum())} of {num_pairs} pairs")
    splits = {"train": train.merged(dims, device)}
    if eval_batches is not None:
        held_out = _PairTable(num_eval_pairs)
        for batch, counted in eval_batches:
            seq = PreferenceObjective.sequences(batch, device)
            logps = sequence_logps(model, to_device(model_inputs(batch)), seq)
            if counted:
                held_out.add(batch["pair_index"], logps, _valid_pairs(seq))
        splits["eval"] = held_out.merged(dims, device)
    return PrecomputedReference(splits)
