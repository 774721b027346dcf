"""What a training step minimises and what else a stage holds: one objective class per `training.stage`.

A stage is its objective. Each class declares, for the stage it is registered under (`mmfsdp.train.stages`):

- its models (`build`, from an `ObjectiveContext` the trainer fills): the policy is the trainer's; a stage adds what
  it needs beside it (DPO: a reference; a stage with generation would add its rollout engine);
- its step: the loop (`Trainer.train_step`) is the same for every stage: it hands the step's micro-batches to
  `objective.start_step` (before any forward: the global normalisers), which returns the micro-batches to train on
  (the same ones; GRPO's: the completions it generates from the loader's prompts; none are taken from the loader
  for a step whose `objective.needs_batch()` says no: GRPO's later iterations on one batch), then for each
  micro-batch calls
  `objective.micro_batch(model, i, inputs)`, which runs the forward(s) and returns the model output and this rank's
  share of the step objective (the shares of all ranks and micro-batches add up to the global objective; the loop
  backpropagates `share × world_size`, docs/parallelism.md), and at the end reads `objective.stats()` (device
  tensors, and the collectives that still write into them);
- its config rules (`configure`, `check_config`: called by `mmfsdp.train.config` before any process group), its
  memory-plan terms (`sequences_per_sample`, `memory_terms`, `memory_savings`: `mmfsdp.train.memory`), its
  held-out metrics (`eval_metrics` at the end, `validation_metrics` at each validation step:
  `mmfsdp.train.evaluate`) and what its checkpoints record (`checkpoint_metadata`,
  `resumes`: `mmfsdp.train.checkpointer`, `mmfsdp.train.start`; `state_dict`: this rank's state between steps,
  saved with the trainer's per-rank state and given back to `build` as `ObjectiveContext.state`).

No other module compares `training.stage` (tests/test_stage_isolation.py). This module holds the base and the
SFT objective; each other stage is a module of its own beside it (`mmfsdp.train.dpo`, `mmfsdp.train.grpo`).

- `SFTObjective` (`stage: sft`): the weighted cross-entropy of `mmfsdp.model.loss`.
- `PreferenceObjective` (`stage: dpo`, `mmfsdp.train.dpo`): a preference loss on per-sequence log-probabilities (`mmfsdp.model.preference`,
  TRL's definitions). The forward returns the summed cross-entropy of each sequence of the micro-batch (chosen_0,
  rejected_0, chosen_1, ...), whole on every CP rank; the reference's log-probabilities of the same sequences
  come from a `Reference`, chosen by one rule (`PreferenceObjective.reference_kind`):
  - `PrecomputedReference` (`training.dpo.precompute_ref_logps`): the initial model's log-probabilities of every
    pair, computed once before the first step over exactly the micro-batches the run will train on, saved to
    `<output_dir>/ref_logps.safetensors` (a resumed run reads them back) and looked up by `pair_index`;
  - else `LoraReference`: with LoRA, the policy itself with its adapters switched off (no second copy);
  - else `FrozenReference`: full fine-tuning, a frozen copy of the initial model sharded with FSDP2 like the policy.
  Under context parallel every CP rank holds the whole pairs' values, so each scales its share by `1 / cp_size`;
  the sums' all-reduce sums the gradients over the CP group in backward (`mmfsdp.model.training_forward`, step 7).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from mmfsdp.config import get_logger, warn_once
from mmfsdp.model import compute_loss_weights, shift_labels

__all__ = ["Objective", "ObjectiveContext", "MemoryTerm", "SFTObjective"]

log = get_logger("mmfsdp.train")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectiveContext:
    """What a stage's `build` may use of the run; the trainer fills it once the policy is built and resumed."""

    cfg: Any
    """The whole config (a stage reads its own section and `training`)."""
    dims: Any
    """The mesh (`mmfsdp.parallel.ParallelDims`)."""
    device: torch.device
    rank: int
    output_dir: Path
    step: int
    """The step the run resumes after (0: a fresh start)."""
    model: torch.nn.Module
    """The policy: built, sharded, loaded (and resumed)."""
    train_dataset: Any
    evaluator: Any
    """The run's `Evaluator` (`evaluates`, `dataset`, `batches`: the evaluation split)."""
    frozen_copy: Callable[[], torch.nn.Module]
    """Builds a frozen copy of the initial model, sharded like the policy."""
    train_collator: Any
    """The training loader's collator (GRPO collates its generated sequences with the family collator inside)."""
    fresh_loader: Callable[[], Any]
    """Builds a training loader in the run's current data state (the micro-batches the run will train on next)."""
    to_device: Callable[[dict[str, Any]], dict[str, Any]]
    state: dict[str, Any] | None = None
    """This rank's stage state saved with the checkpoint the run resumes (`Objective.state_dict`); None: a fresh
    start, a checkpoint of another world size (per-rank state is not restored) or none saved."""
    draw_step: Callable[[], list[dict[str, Any]]] | None = None
    """Takes the next step's micro-batches from the run's own loader, beyond the one the trainer hands `start_step`
    (GRPO's dynamic sampling); what it takes moves the loader, so the checkpointed data position counts it."""


@dataclass(frozen=True, slots=True)
class MemoryTerm:
    """Device memory per rank of a model a stage holds beside the policy (`Objective.memory_terms`)."""

    name: str
    """What it is, for code (`reference`)."""
    label: str
    """Its name in the memory plan's lines (`DPO reference`)."""
    bytes: int
    note: str
    """How it is counted, in the plan's line."""
    phase: str = "step"
    """When it is alive: `step`, all through the step (a reference copy); `generation`, only while the stage
    generates, before the training forwards (a rollout's KV cache): the plan counts the larger of those and the
    activations, not their sum."""


class Objective(abc.ABC):
    """One training stage (module docstring): class-level hooks that answer for a config before any process
    exists, and an instance, built by `build`, that runs the steps. The defaults are a stage with nothing beside
    the policy."""

    stage: ClassVar[str]
    """The `training.stage` it is registered under (`mmfsdp.train.stages`), recorded in its checkpoints."""
    sequences_per_sample: ClassVar[int] = 1
    """Sequences one sample of `micro_batch_size` brings (the memory plan's tokens; `sequence_shape`)."""

    @classmethod
    def sequence_shape(cls, cfg) -> tuple[int, int]:
        """(sequences one sample of `micro_batch_size` brings, the most tokens of each) for the memory plan: by default
        `sequences_per_sample` sequences of up to `cutoff_len` tokens."""
        return cls.sequences_per_sample, cfg.data.dataset_param.preprocess_parameters.cutoff_len

    # -- the config, before any process group ---------------------------------------------------------------------
    @classmethod
    def configure(cls, cfg) -> None:
        """Fill in the settings the stage implies (called when the config is built)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """The stage's rules across sections: raise a `ConfigError` naming the key (`check_sections`)."""

    @classmethod
    def eval_data(cls, data_cfg) -> Any:
        """The data config the held-out evaluation reads (`mmfsdp.train.evaluate.Evaluator`): the run's own."""
        return data_cfg

    @classmethod
    def loader_plan(cls, cfg) -> tuple[Any, int | None]:
        """The data config and token budget the training loader plans its steps with: the run's
        (`data.dataloader_param.balance`, `training.micro_batch_tokens`). A stage that plans its own training
        micro-batches (GRPO: of the completions, known after generation) gives its loader neither."""
        return cfg.data, cfg.training.micro_batch_tokens

    @classmethod
    def memory_terms(cls, cfg, model: torch.nn.Module, shard_size: int) -> list[MemoryTerm]:
        """The device memory of the stage's own models per rank (`model`: the policy on the meta device)."""
        return []

    @classmethod
    def memory_savings(cls, cfg) -> list[tuple[str, Any]]:
        """Single config changes that drop one of `memory_terms`: (the setting, the changed config)."""
        return []

    # -- checkpoints -------------------------------------------------------------------------------------------------
    @classmethod
    def checkpoint_metadata(cls) -> dict[str, Any]:
        """What its checkpoints record (`checkpoint.json`'s `metadata`): the stage that trained them."""
        return {"stage": cls.stage}

    @staticmethod
    def recorded_stage(metadata: dict[str, Any] | None) -> str:
        """The stage a checkpoint's metadata records; none recorded: `sft` (checkpoints from before stages)."""
        return (metadata or {}).get("stage", SFTObjective.stage)

    @classmethod
    def resumes(cls, metadata: dict[str, Any] | None) -> bool:
        """Whether a run of this stage resumes a checkpoint with `metadata`: only its own stage's (another stage's
        checkpoint gives a run its initial weights, `mmfsdp.train.start`)."""
        return cls.recorded_stage(metadata) == cls.stage

    # -- the run -----------------------------------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def build(cls, ctx: ObjectiveContext) -> Objective:
        """The objective of a run, with the models it holds beside the policy."""

    def needs_batch(self) -> bool:
        """Whether the next step takes its micro-batches from the loader; a stage that trains several steps on one
        batch (GRPO's `num_iterations`) says no in between, and its `start_step` then gets none."""
        return True

    @abc.abstractmethod
    def start_step(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Before the step's first forward: what the step needs from all the loader's micro-batches (global
        normalisers); returns the micro-batches the step trains on (the loader's, or, for a stage that generates,
        the ones it builds from them; `[]` from the trainer when `needs_batch` said no)."""

    @abc.abstractmethod
    def micro_batch(self, model, index: int, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """The forward(s) of micro-batch `index`: the model output and this rank's share of the step objective."""

    def stats(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        """The step's statistics (device tensors) and the collectives still writing into them."""
        return {}, []

    def state_dict(self) -> dict[str, Any]:
        """This rank's state that a checkpoint after the current step must keep for the run to continue bitwise
        (given back as `ObjectiveContext.state`); plain tensors, numbers, strings and containers."""
        return {}

    def eval_metrics(self) -> Any | None:
        """The stage's own held-out metrics (`mmfsdp.train.evaluate.ObjectiveMetrics`), or None."""
        return None

    def close(self) -> None:
        """Release what the objective holds outside the training processes (GRPO: a rollout server it launched,
        its reward workers); the trainer calls it on every rank at the end of the run, also when it stops on an
        error."""

    def validation_metrics(self, step: int) -> dict[str, float]:
        """The stage's own held-out metrics at validation step `step`, beside `val_loss` (a collective: the
        evaluator calls it on every rank; GRPO: the held-out greedy reward, `mmfsdp.train.grpo_validation`)."""
        return {}


class SFTObjective(Objective):
    """`stage: sft`: Σ_t w_t · CE_t with the step's global normalisers (`mmfsdp.model.compute_loss_weights`)."""

    stage = "sft"

    def __init__(self, cfg, dims, device: torch.device):
        self.loss_type = cfg.features.loss_cfg.loss_type
        self.dims = dims
        self.device = device
        self._targets: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.data.dataset_param.attr.ranking:
            warn_once(
                "data.dataset_param.attr.ranking is true with training.stage: sft: the run trains on the rejected "
                "answers too (for preference training set training.stage: dpo)", log,
            )

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> SFTObjective:
        return cls(ctx.cfg, ctx.dims, ctx.device)

    def start_step(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # on the device before the loss weights: their normaliser then stays there (no host wait)
        self._targets = [shift_labels(mb["labels"], mb.get("cu_seq_lens")).to(self.device) for mb in micro_batches]
        self._weights = compute_loss_weights(
            self._targets, loss_type=self.loss_type, cu_seq_lens=[mb.get("cu_seq_lens") for mb in micro_batches],
            group=self.dims.dp_group, num_micro_batches=len(micro_batches),
        )
        return micro_batches

    def micro_batch(self, model, index: int, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        out = model(**inputs, shift_labels=self._targets[index], loss_weights=self._weights[index])
        return out, out.loss
