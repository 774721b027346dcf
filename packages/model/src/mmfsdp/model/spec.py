"""The spec of a model family: what the trainer reads of a family without knowing it (docs/families.md).

torchtitan's `ModelSpec` is the example. A family declares one `ModelEntry` subclass, decorated with
`@register_model("id")`:

- required (`REQUIRED_MEMBERS`; `register_model` refuses a spec without them): the model id (the decorator sets
  it), the HF config and model classes, the default FSDP2 and activation-checkpointing plans as module name
  patterns, `build` and `init_non_persistent_buffers` — `mmfsdp.model.hf_family.HFFamilyEntry` has the last two
  for any HF model class, so an HF family writes four class attributes;
- declared, with defaults that support nothing: the vision, expert and router modules, `capabilities` (context
  parallel, packing, an expert layout, video), `data` (the registry names of the `mmfsdp.data` pieces its
  batches come from; this package never imports the data package) and `lora_presets` (named LoRA targets), so
  the trainer's checks refuse an unsupported or mismatched choice before any process starts
  (`mmfsdp.model.checks`);
- two facets apart from the declaration: `costs` (`FamilyCosts`: FLOPs and activation memory) and `testkit`
  (`FamilyTestKit`: tiny configs and batches for tests);
- hooks with defaults: the state-dict adapter, `validate_parallel`, `step_terms` (what a family adds to a
  training step beyond `outputs.loss`, e.g. a MoE's router loss; the loop names no family concept),
  `num_experts` and `parallelize` (the generic `mmfsdp.model.parallelize.parallelize` unless overridden).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, TypeVar

import torch
from torch import nn

from mmfsdp.config import ConfigError
from mmfsdp.model.costs import FamilyCosts
from mmfsdp.model.registry import add_family, find_family
from mmfsdp.model.testkit import FamilyTestKit

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.utils import ModelOutput

    from mmfsdp.ckpt.adapters import StateDictAdapter
    from mmfsdp.model.config import FeaturesConfig, LossConfig, ModelConfig
    from mmfsdp.parallel import MeshPlan, ParallelConfig, ParallelDims

__all__ = [
    "Capabilities", "DataNames", "ModelEntry", "REQUIRED_MEMBERS", "StepTerms", "current_module_name", "get_model_entry",
    "missing_members", "register_model",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a family supports beyond plain FSDP2 data parallel; everything is off unless the family declares it,
    and `--check` refuses a config that asks for what is off."""

    context_parallel: bool = False
    """Ulysses and Ring attention over the decoder's sequence (the decoder's attention is full causal attention
    through transformers' attention interface, which context parallel replaces)."""
    packing: bool = False
    """Several samples per row delimited by `cu_seq_lens` (every decoder attention call takes the varlen keywords,
    and the family's inputs restart per sample where they must, e.g. M-RoPE positions)."""
    expert_layout: str | None = None
    """MoE families: the layout of the stacked expert weights that expert parallel splits, one of
    `mmfsdp.parallel.expert_parallel.EXPERT_LAYOUTS`; None for a dense family."""
    video: bool = False
    """Video rows (`data.dataset_param.attr.videos`): the family's image plugin reads videos and its model takes
    `pixel_values_videos` / `video_grid_thw`."""

    def check_parallel(self, model_id: str, plan: MeshPlan) -> None:
        """Refuse (`ConfigError`) the parallel layout's context parallel unless declared, and expert parallel
        without an expert layout (a dense family) or with one `mmfsdp.parallel` does not know."""
        cp_sizes = (("parallel.ulysses_parallel_size", plan.ulysses), ("parallel.ring_attention_size", plan.ring))
        for key, size in cp_sizes:
            if size > 1 and not self.context_parallel:
                raise ConfigError(
                    key,
                    f"{size} needs context parallel, which model_id {model_id!r} does not support "
                    "(its entry does not declare capabilities.context_parallel); set it to 1",
                )
        if plan.ep <= 1:
            return
        if self.expert_layout is None:
            raise ConfigError(
                "parallel.expert_parallel_size",
                f"{plan.ep} needs a mixture-of-experts model, but model_id {model_id!r} is dense (no experts to "
                "split); set it to 1",
            )
        from mmfsdp.parallel.expert_parallel import EXPERT_LAYOUTS

        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ConfigError(
                "parallel.expert_parallel_size",
                f"{plan.ep}: model_id {model_id!r} declares expert layout {self.expert_layout!r}, which expert "
                f"parallel cannot split (it knows {', '.join(EXPERT_LAYOUTS)}); set it to 1",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class DataNames:
    """The `mmfsdp.data` pieces a family's batches come from, by the registry names users write in YAML; the first
    of each is the family's default. A family that lists none of a kind accepts none (its data is its own)."""

    templates: tuple[str, ...] = ()
    """`data.dataset_param.preprocess_parameters.template` values that tokenise for this family."""
    image_plugins: tuple[str, ...] = ()
    """`data.dataset_param.preprocess_parameters.image_plugin` values (or the template's default plugin)."""
    collators: tuple[str, ...] = ()
    """`data.dataloader_param.collate_param.model_name` values whose batches this family's forward takes."""


class StepTerms:
    """What a family adds to one optimizer step (`ModelEntry.step_terms`, a fresh one per step): an extra loss
    term per micro-batch and statistics of the step for the log. This base adds nothing.

    The trainer calls `loss` once per micro-batch, in order, after the forward and before the backward, and
    `stats` once after the last micro-batch; every rank calls both, so either may run collectives.
    """

    def loss(self, outputs: ModelOutput, *, num_micro_batches: int) -> torch.Tensor | None:
        """This rank's share of the micro-batch's extra loss (with grad), added to `outputs.loss` before backward
        and scaled like it (shares summed over ranks give the global batch's term); None: nothing to add."""
        return None

    def stats(self) -> dict[str, torch.Tensor]:
        """The step's statistics: name -> 0-d device tensor, equal on every rank. They join the step's record
        (`metrics.jsonl`, the log line, the sinks) under these names; the trainer reads them on logging steps only."""
        return {}


class ModelEntry:
    """A model family's spec (module docstring): subclasses set the required members; the rest has defaults."""

    # required (REQUIRED_MEMBERS): the model id comes from @register_model; HFFamilyEntry has build and the init
    model_id: str = ""
    config_class: type[PretrainedConfig] | None = None
    """The HF config class of the family (what its config.json must describe)."""
    model_class: type[nn.Module] | None = None
    """The model class `build` returns (for HF families, `TrainingForwardMixin` + the HF class)."""
    fsdp_modules: tuple[str, ...] = ()
    """Default `parallel.fsdp_plan.apply_modules`: each matched module becomes one FSDP2 group."""
    recompute_modules: tuple[str, ...] = ()
    """Default activation-checkpointing patterns (those under the decoder are what `features.compile` compiles)."""

    def build(self, model_cfg: ModelConfig, features_cfg: FeaturesConfig | None = None, *,
              device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
        """The model of `model.model_name_or_path` on `device`: on "meta" from its config alone."""
        raise NotImplementedError

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        """After a meta build and `to_empty`: fill the buffers no checkpoint holds (rotary `inv_freq`, ...)."""
        raise NotImplementedError

    # declared, with defaults that support nothing
    vision_modules: tuple[str, ...] = ()
    """Modules on the vision side: replicated over context parallel, run on whole images."""
    expert_modules: tuple[str, ...] = ()
    """MoE families: the modules holding the stacked expert weights (`[E, ...]`), what expert parallel shards;
    empty for a dense model. Their training forward also returns `outputs.router_load` (`mmfsdp.model.router`)."""
    router_modules: tuple[str, ...] = ()
    """MoE families: the routers (replicated over expert parallel)."""
    absent_modules: tuple[tuple[str, str], ...] = ()
    """(module name, why) of modules that the family's published training configs name but its model does not
    build (Qwen3.5's multi-token-prediction head `mtp`): a configured plan pattern equal to one is skipped with a
    warning instead of failing as a pattern that matches nothing."""
    legacy_module_names: tuple[tuple[str, str], ...] = ()
    """(module prefix in another layout, the model's prefix): the names its published training configs may use
    for the same modules (transformers 4's layout, or the seed system's own modeling file). A configured module name
    under one of the left prefixes and under none of the right ones means the right one (`current_module_name`);
    the app rewrites the configured module lists so before anything reads them."""
    capabilities: Capabilities = Capabilities()
    """What the family supports (context parallel, packing, expert layout, video); off unless declared."""
    data: DataNames = DataNames()
    """The templates, image plugins and collators (registry names of `mmfsdp.data`) that fit the family."""
    lora_presets: Mapping[str, tuple[str, ...]] = MappingProxyType({})
    """Named LoRA target lists (`training.lora.target_modules: [preset:<name>]`, `mmfsdp.model.lora`): leaf names
    or module patterns of this family's model, each of which must match a module."""

    # facets
    costs: FamilyCosts = FamilyCosts()
    """FLOPs (MFU) and activation memory (the memory plan) of the family's model."""
    testkit: FamilyTestKit = FamilyTestKit()
    """Tiny configs and batches for tests (the family contract test)."""

    @property
    def decoder_name(self) -> str:
        """The text decoder module (the model class's `decoder_name`)."""
        return getattr(self.model_class, "decoder_name", "model.language_model")

    @property
    def lm_head_name(self) -> str:
        """The output projection that receives the loss function under chunk loss (the model class's `lm_head_name`)."""
        return getattr(self.model_class, "lm_head_name", "lm_head")

    # hooks, with defaults
    def state_dict_adapter(self) -> StateDictAdapter:
        """HF file names and layouts <-> `state_dict()`: by default the adapter an installed package declares under
        this model id (entry-point group `mmfsdp.state_dict_adapters`); a family outside one returns its own."""
        from mmfsdp.ckpt.adapters import get_state_dict_adapter

        return get_state_dict_adapter(self.model_id)

    def validate_parallel(self, model_cfg: ModelConfig, plan: MeshPlan) -> None:
        """Checks of the parallel layout against the model, before any process group (`ConfigError`). Default:
        refuse what `capabilities` does not declare (`Capabilities.check_parallel`)."""
        self.capabilities.check_parallel(self.model_id, plan)

    def kernel_lines(self, model_cfg: ModelConfig, device_type: str) -> list[str]:
        """`--check`'s lines on the family's own kernel choices: which implementation runs on `device_type` and
        why. Default: none."""
        return []

    def step_terms(self, loss_cfg: LossConfig) -> StepTerms:
        """A fresh `StepTerms` for one optimizer step (`loss_cfg`: `features.loss_cfg`). Default: none."""
        return StepTerms()

    def num_experts(self, config: PretrainedConfig) -> int | None:
        """Experts per MoE layer in the HF `config`; None for a dense family."""
        return None

    def parallelize(self, model: nn.Module, parallel_cfg: ParallelConfig, parallel_dims: ParallelDims,
                    features_cfg: FeaturesConfig | None = None) -> nn.Module:
        """Expert parallel, compile, checkpointing, offload, then FSDP2, in place before the weights are loaded;
        default: `mmfsdp.model.parallelize.parallelize` over this spec's patterns."""
        from mmfsdp.model.parallelize import parallelize

        return parallelize(self, model, parallel_cfg, parallel_dims, features_cfg)


REQUIRED_MEMBERS = (
    "model_id", "config_class", "model_class", "fsdp_modules", "recompute_modules", "build",
    "init_non_persistent_buffers",
)
"""What every spec sets: the members without a default that fits any family (docs/families.md counts them)."""


def missing_members(cls: type[ModelEntry]) -> list[str]:
    """The required members spec class `cls` leaves at the base's placeholder (`model_id`, set on registration,
    not included)."""
    return [name for name in REQUIRED_MEMBERS[1:] if getattr(cls, name) == getattr(ModelEntry, name)]


E = TypeVar("E", bound=type[ModelEntry])


def register_model(model_id: str) -> Callable[[E], E]:
    """Class decorator: register one instance of the decorated spec class under `model_id` (it sets `model_id`);
    a `TypeError` if the class leaves a required member unset."""

    def decorate(cls: E) -> E:
        missing = missing_members(cls)
        if missing:
            raise TypeError(f"model family {model_id!r} ({cls.__qualname__}) does not set {', '.join(missing)}")
        entry = cls()
        entry.model_id = model_id
        add_family(model_id, entry)
        return cls

    return decorate


def get_model_entry(model_id: str) -> ModelEntry:
    """The spec registered under `model_id`, importing its family on first use; an unknown id is a `ConfigError`
    naming the closest one."""
    entry = find_family(model_id)
    assert isinstance(entry, ModelEntry), f"{model_id!r} is registered as {type(entry).__name__}, not a ModelEntry"
    return entry


def current_module_name(name: str, legacy: tuple[tuple[str, str], ...]) -> str:
    """`name` (a configured module name or pattern) in the model's layout: unchanged when it is under one of the
    model's prefixes (the right side of `legacy`, a family's `legacy_module_names`) or under none of the other
    layout's; else its longest legacy prefix replaced by the model's (`visual.blocks.{*}` ->
    `model.visual.blocks.{*}`, `model.layers.{*}` -> `model.language_model.layers.{*}`)."""

    def under(prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    if any(under(current) for _, current in legacy):
        return name
    for old, current in sorted(legacy, key=lambda pair: -len(pair[0])):
        if under(old):
            return current + name[len(old):]
    return name

