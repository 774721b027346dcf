"""The reference model of a stage that keeps its policy near the initial model (DPO, GRPO's KL term), and the
one rule that picks it when it is a live model (`live_reference_kind`): with LoRA the policy itself with its
adapters switched off (`LoraReference`, no second copy), else a frozen copy of the initial model sharded with FSDP2
like the policy (`FrozenReference`). DPO adds a precomputed table (`mmfsdp.train.dpo.PrecomputedReference`); an
online stage cannot precompute (its sequences are generated during the run).

A reference's `logps(inputs, seq, index)` runs the training forward with the stage's keywords `seq` and returns
minus its `.loss`: per-sequence log-probabilities with DPO's `sequence_ids`, per-token ones with GRPO's
`per_token` (`mmfsdp.model.training_forward`, steps 7 and 8); `index` is for tables and unused by live models.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal

import torch

from mmfsdp.config import ConfigError, get_logger
from mmfsdp.train.objective import ObjectiveContext

__all__ = [
    "FrozenReference",
    "LIVE_REFERENCES",
    "LoraReference",
    "ReferenceKind",
    "adapters_disabled",
    "frozen_copy_bytes",
    "live_reference_kind",
    "sequence_logps",
]

log = get_logger("mmfsdp.train")

ReferenceKind = Literal["precomputed", "lora", "frozen"]


def live_reference_kind(training) -> ReferenceKind:
    """The live reference of a run of the `training` section (the one rule): with LoRA the policy with its adapters
    off, else a frozen copy of the initial model."""
    return "lora" if training.lora.enable else "frozen"


def frozen_copy_bytes(cfg, model: torch.nn.Module, shard_size: int) -> int:
    """Device bytes per rank of a `FrozenReference` of `model` (the policy on the meta device): its parameters in
    `model.dtype`, sharded over `shard_size` ranks."""
    from mmfsdp.parallel.dtypes import DTYPES

    return sum(p.numel() * DTYPES[cfg.model.dtype].itemsize for p in model.parameters()) // shard_size


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The model without its LoRA adapters, restored on exit. Only PEFT's switch (`disable_adapters`) is flipped, not
    `enable_adapters`, which also sets the adapters' `requires_grad`: around a forward of an FSDP2 model sharded over
    2 processes, switching back left the sharded adapters with `requires_grad` False (GRPO's LoRA run on 2
    processes, tests/test_e2e_grpo.py), so they stopped training. The reference runs without gradients anyway."""
    layers = _lora_layers(model)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def sequence_logps(model, inputs: dict[str, Any], seq: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return -model(**inputs, **seq).loss.detach()


class LoraReference:
    """The policy with its LoRA adapters off: the base model, without a second copy."""

    def __init__(self, model: torch.nn.Module):
        if not _lora_layers(model):
            raise ConfigError("training.lora.enable", "a LoRA reference needs LoRA adapters in the model")
        self.model = model

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> LoraReference:
        return cls(ctx.model)

    def for_split(self, split: str) -> LoraReference:
        """A live model: the same reference for every split."""
        return self

    def logps(self, inputs: dict[str, Any], seq: dict[str, Any], pair_index: torch.Tensor) -> torch.Tensor:
        with adapters_disabled(self.model):
            return sequence_logps(self.model, inputs, seq)


class FrozenReference:
    """A frozen copy of the initial model, built and sharded like the policy (`ObjectiveContext.frozen_copy`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> FrozenReference:
        model = ctx.frozen_copy()
        log.info(f"reference model: a frozen copy of the initial {ctx.cfg.model.model_id}")
        return cls(model)

    def for_split(self, split: str) -> FrozenReference:
        """A live model: the same reference for every split."""
        return self

    def logps(self, inputs: dict[str, Any], seq: dict[str, Any], pair_index: torch.Tensor) -> torch.Tensor:
        return sequence_logps(self.model, inputs, seq)


LIVE_REFERENCES: dict[str, Any] = {"lora": LoraReference, "frozen": FrozenReference}
"""The live reference of each kind (`live_reference_kind`), built by its `build(ctx)`."""
