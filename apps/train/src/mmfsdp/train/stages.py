"""The training stages, keyed by the name users write as `training.stage`: each is its objective class
(`mmfsdp.train.objective`), which owns everything that differs between stages. The trainer, the config checks, the
memory plan, the evaluator and the checkpoints look the class up here and ask it; none of them compares the name.

Adding a stage is a class (its models, step, config rules, memory terms, metrics) and a line in `STAGES`; the
allowed values of `training.stage` are these names.
"""

from __future__ import annotations

from mmfsdp.config import ConfigError
from mmfsdp.train.dpo import PreferenceObjective
from mmfsdp.train.grpo import GRPOObjective
from mmfsdp.train.objective import Objective, SFTObjective

__all__ = ["STAGES", "STAGE_NAMES", "objective_class"]

STAGES: dict[str, type[Objective]] = {cls.stage: cls for cls in (SFTObjective, PreferenceObjective, GRPOObjective)}
"""`training.stage` → its objective class, the default (`sft`) first."""

STAGE_NAMES: tuple[str, ...] = tuple(STAGES)
"""The values `training.stage` may take."""


def objective_class(stage: str) -> type[Objective]:
    """The objective class of `stage` (a `training.stage` value)."""
    try:
        return STAGES[stage]
    except KeyError:
        raise ConfigError("training.stage", f"{stage!r} is not one of {', '.join(map(repr, STAGE_NAMES))}") from None
