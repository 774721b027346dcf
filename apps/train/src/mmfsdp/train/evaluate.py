"""Evaluation, the training loop's component for held-out data (`Evaluator`): the validation loss every
`training.val_interval` steps (`validate(step)` decides, pauses the heartbeat and keeps it in `val_losses`; the
stage's own validation metrics, `Objective.validation_metrics`, join it in `val_stats`),
and at the end of a run the exact-match accuracy of the trained span.

A sample counts as correct when, under teacher forcing, the argmax prediction
equals the target at every trained position (the assistant answer and its EOS).
That is the same as greedy decoding producing the answer exactly, without a
generation loop. Each data-parallel rank scores a strided share of the eval set;
every rank runs the same number of forward passes (FSDP2 gathers parameters
collectively), repeating its last batch uncounted where its share is shorter.
Counts are summed over the data-parallel group. Rank 0 writes
`<output_dir>/eval.json` with `accuracy`, `chance` (when the dataset declares
it), `num_samples` and `num_correct`.

Preference data: the evaluation split holds pairs; `accuracy` is then the chosen answers' exact match (greedy
decoding gives the chosen answer). A stage adds its own metrics to eval.json through `objective_metrics` (its
objective's `eval_metrics`, `ObjectiveMetrics`; DPO: the held-out `reward_accuracy` and `reward_margin` against the
run's reference, `mmfsdp.train.dpo.PairRewards`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError, get_logger
from mmfsdp.data import build_dataset, dataset_files, get_collator
from mmfsdp.model import model_inputs, shift_labels
from mmfsdp.model.batch_plan import HOST_INPUT_KEYS
from mmfsdp.train.supervise import LoopHeartbeat

__all__ = [
    "Evaluator", "ObjectiveMetrics", "exact_match", "has_eval_split", "dataset_chance", "media_kinds", "to_device",
]

log = get_logger("mmfsdp.train")


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of `batch` on `device` (non-blocking), but the sample bounds (`HOST_INPUT_KEYS`): the model's
    batch plan reads them on the host; other values as they are."""
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) and k not in HOST_INPUT_KEYS else v
        for k, v in batch.items()
    }


@torch.no_grad()
def exact_match(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row: True when every position with a target (!= -100) is predicted exactly."""
    predicted = logits.argmax(dim=-1)
    trained = targets != -100
    wrong = (predicted != targets) & trained
    return (~wrong.any(dim=-1)) & trained.any(dim=-1)


class ObjectiveMetrics(Protocol):
    """A stage's own held-out metrics (`Objective.eval_metrics`): sums over the evaluation batches, reduced over the
    data-parallel group, then the keys they give eval.json."""

    num_sums: int

    def batch(self, batch: dict[str, Any], inputs: dict[str, Any], logits: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
        """float64 `[num_sums]` of one batch from the policy's logits and the shifted targets (on the host) and the
        model inputs (on the device); called on every rank for every batch, counted or not."""
        ...

    def result(self, sums: list[float]) -> dict[str, Any]: ...

    def describe(self, result: dict[str, Any]) -> str:
        """The log line's words for `result`."""
        ...


class Evaluator:
    """Validation loss and held-out accuracy of `model` on the evaluation split (built on first use)."""

    def __init__(
        self, cfg: Any, *, model: torch.nn.Module, processor: Any, dims: Any, device: torch.device,
        pad_multiple: int, output_dir: Path, rank: int, heartbeat: LoopHeartbeat | None = None, data: Any = None,
    ):
        self.cfg = cfg
        self._data = data
        self.heartbeat = heartbeat or LoopHeartbeat()
        self.model = model
        self.processor = processor
        self.dims = dims
        self.device = device
        self.pad_multiple = pad_multiple
        self.output_dir = output_dir
        self.rank = rank
        self.dataset = None
        """The evaluation split, built on first use."""
        self.val_losses: dict[int, float] = {}
        """Validation loss by step (`validate`)."""
        self.val_stats: dict[int, dict[str, float]] = {}
        """The stage's validation metrics by step (`validate`; `stage_validation`'s)."""
        self.stage_validation: Callable[[int], dict[str, float]] | None = None
        """The stage's validation metrics (`Objective.validation_metrics`), set once the trainer has built the
        objective."""
        self.objective_metrics: ObjectiveMetrics | None = None
        """The stage's own metrics (`Objective.eval_metrics`), set once the trainer has built the objective."""

    @property
    def data(self) -> Any:
        """The data config of the evaluation split (`Objective.eval_data`; by default the run's)."""
        return self.cfg.data if self._data is None else self._data

    def media_kinds(self) -> frozenset[str] | None:
        """The kinds of media of the evaluation split (built now) when the run evaluates, empty when it does
        not; None when the dataset cannot say (`media_kinds`)."""
        if not (self.cfg.training.val_interval or has_eval_split(self.data)):
            return frozenset()
        if self.dataset is None:
            self.dataset = build_dataset(self.data, self.processor, split="eval")
        return media_kinds(self.dataset)

    def evaluates(self) -> bool:
        """Whether the run uses the evaluation split (validation or the final accuracy); builds it then."""
        if not (self.cfg.training.val_interval or has_eval_split(self.data)):
            return False
        if self.dataset is None:
            self.dataset = build_dataset(self.data, self.processor, split="eval")
        return True

    def should_validate(self, step: int) -> bool:
        interval = self.cfg.training.val_interval
        return bool(interval) and step % interval == 0

    def validate(self, step: int) -> float | None:
        """After step `step`: the validation loss when `training.val_interval` asks for it (collective; the
        heartbeat waits), kept in `val_losses`; None on other steps."""
        if not self.should_validate(step):
            return None
        with self.heartbeat.paused(f"validation at step {step}", step):
            loss = self.validation_loss()
            self.val_stats[step] = self.stage_validation(step) if self.stage_validation is not None else {}
        self.val_losses[step] = loss
        return loss

    def batches(self) -> Iterator[tuple[dict[str, Any], bool]]:
        """(batch, counted) of this rank's strided share of the evaluation split, `eval_batch_size` samples each.

        Every rank yields the same number of batches (FSDP2 gathers parameters collectively): where its share is
        shorter it repeats its last batch, with `counted` False.
        """
        cfg, dims = self.cfg, self.dims
        if self.dataset is None:
            self.dataset = build_dataset(self.data, self.processor, split="eval")
        dataset = self.dataset
        collate = get_collator(self.data.dataloader_param.collate_param.model_name)(
            pad_token_id=dataset.processor.pad_token_id, pad_to_multiple_of=self.pad_multiple, packing=False,
        )
        if getattr(dataset, "is_preference", False):
            from mmfsdp.data.collators import PairCollator

            collate = PairCollator(collate)
        indices = list(range(dims.dp_rank, len(dataset), dims.dp_size))
        batch_size = cfg.training.eval_batch_size
        num_batches = math.ceil(math.ceil(len(dataset) / dims.dp_size) / batch_size)
        for b in range(num_batches):
            chunk = indices[b * batch_size : (b + 1) * batch_size]
            real = bool(chunk)
            if not real:
                chunk = indices[-batch_size:] or [0]
            items = [item for item in (dataset[i] for i in chunk) if "bad_reason" not in item]
            if not items:  # every image of this chunk failed to decode; keep the collective count equal
                first_good = next(item for item in map(dataset.__getitem__, range(len(dataset))) if "bad_reason" not in item)
                items, real = [first_good], False
            yield collate(items), real

    @torch.no_grad()
    def accuracy(self, step: int) -> dict:
        """Exact-match accuracy over the evaluation split (collective), with chance and counts."""
        model = self.model
        model.eval()
        if self.dataset is None:
            self.dataset = build_dataset(self.data, self.processor, split="eval")
        pairs = getattr(self.dataset, "is_preference", False)
        extra = self.objective_metrics
        # exact matches, samples, then the objective's own sums
        totals = torch.zeros(2 + (extra.num_sums if extra is not None else 0), dtype=torch.float64)
        for batch, real in self.batches():
            inputs = to_device(model_inputs(batch), self.device)
            logits = model(**inputs).logits.float().cpu()
            targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
            hits = exact_match(logits, targets)
            if pairs:
                hits = hits[0::2]  # the chosen answers
            if extra is not None:
                extra_sums = extra.batch(batch, inputs, logits, targets)
            if real:
                totals[0] += hits.sum()
                totals[1] += hits.numel()
                if extra is not None:
                    totals[2:] += extra_sums
        model.train()
        totals = totals.to(self.device)
        dist.all_reduce(totals, group=self.dims.dp_group)
        num_correct, num_samples = (int(v) for v in totals[:2].tolist())
        result = {
            "accuracy": num_correct / max(num_samples, 1),
            "chance": dataset_chance(self.data),
            "num_samples": num_samples,
            "num_correct": num_correct,
            "step": step,
        }
        if extra is not None:
            result.update(extra.result(totals[2:].tolist()))
        return result

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean cross-entropy per trained token over the whole evaluation split, with the current weights.

        Each micro-batch goes through the training forward with weight 1 on every trained token, so `.loss` is
        this rank's sum (its sequence shard's under context parallel, as in training): the sums are added over
        all ranks and divided by the trained tokens, counted over the data-parallel group (the ranks of one CP
        group see the same samples). With preference data it is the chosen answers' cross-entropy.
        """
        model, device = self.model, self.device
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.int64, device=device)
        for batch, real in self.batches():
            target = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
            weight = (target != -100).float()
            if "pair_index" in batch:
                weight[1::2] = 0.0  # pairs (a sequence per row): the chosen answers' cross-entropy
            if not real:
                weight.zero_()
            out = model(
                **to_device(model_inputs(batch), device), shift_labels=target.to(device), loss_weights=weight.to(device)
            )
            total += out.loss.double()
            tokens += int(weight.sum().item())
        model.train()
        dist.all_reduce(total)
        dist.all_reduce(tokens, group=self.dims.dp_group)
        return float(total / tokens.clamp(min=1))

    def report(self, step: int, file_name: str = "eval.json") -> dict | None:
        """The held-out accuracy after `step` (the final one; 0: `training.eval_on_start`), logged and written to
        `<output_dir>/<file_name>` (None without eval data)."""
        if not has_eval_split(self.data):
            return None
        result = self.accuracy(step)
        chance = result["chance"]
        chance_text = f" (chance {chance:.3f})" if chance is not None else ""
        log.info(f"eval: accuracy {result['accuracy']:.3f}{chance_text} on {result['num_samples']} held-out samples")
        if self.objective_metrics is not None:
            log.info(f"eval: {self.objective_metrics.describe(result)}")
        if self.rank == 0:
            path = self.output_dir / file_name
            path.write_text(json.dumps(result, indent=2) + "\n")
            log.info(f"wrote {path}")
        return result


def media_kinds(dataset: Any) -> frozenset[str] | None:
    """`dataset.media_kinds()` (`"image"`, `"video"`), or None for a dataset without that method."""
    method = getattr(dataset, "media_kinds", None)
    return None if method is None else frozenset(method())


def has_eval_split(data_cfg) -> bool:
    try:
        return bool(dataset_files(data_cfg, "eval"))
    except ConfigError:
        return False


def dataset_chance(data_cfg) -> float | None:
    """Chance accuracy when the dataset declares it (`meta.json` with `chance` in `dataset_dir`)."""
    meta = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser() / "meta.json"
    if meta.is_file():
        value = json.loads(meta.read_text()).get("chance")
        return float(value) if value is not None else None
    return None
