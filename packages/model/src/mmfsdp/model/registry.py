"""The model registry: `model_id` (what users write in YAML) → a `ModelEntry`.

An entry is everything the trainer needs to know about a model family without
knowing the family (torchtitan's `ModelSpec` is the example): its HF config and
model classes, how to build it (on the CPU or on the meta device), its default
FSDP and activation-checkpointing plans as module name patterns, which modules
are the vision side, where the decoder and `lm_head` are, how it is
parallelised (`parallelize`: checkpointing, activation offload, then FSDP2 over
one or more `(patterns, mesh)` groups), how to fill the non-persistent buffers
after a meta build, and (through its state-dict adapter, `state_dict_adapter()`) how HF checkpoint keys map to
its state dict. It also declares what it supports (`capabilities`: context parallel, packing, an expert layout,
video; each off unless declared) and, by registry name, the data pieces its batches come from (`data`:
templates, image plugins, collators of `mmfsdp.data`; this package never imports the data package), so the
trainer's checks refuse an unsupported or mismatched choice before any process starts. What a family adds to a
training step beyond `outputs.loss` — extra loss terms and statistics for the log (a MoE family's router
load-balancing loss and expert load) — comes from its `step_terms` (a `StepTerms`; none by default), so the
training loop names no family concept.
Adding a family means writing an entry, decorating it with
`@register_model("id")` and declaring its module in the `mmfsdp.model_families`
entry-point group of its package (so `registered_model_ids()` knows the id
without importing the module, and `get_model_entry` imports it on first use), not
editing the trainer; most families subclass `mmfsdp.model.hf_family.HFFamilyEntry`,
which builds any HF model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from mmfsdp.config import ConfigError, Registry

__all__ = [
    "Capabilities", "DataNames", "ModelEntry", "StepTerms", "register_model", "get_model_entry", "registered_model_ids",
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

    def loss(self, outputs: Any, *, num_micro_batches: int) -> torch.Tensor | None:
        """This rank's share of the micro-batch's extra loss (with grad), added to `outputs.loss` before backward
        and scaled like it (shares summed over ranks give the global batch's term); None: nothing to add."""
        return None

    def stats(self) -> dict[str, torch.Tensor]:
        """The step's statistics: name -> 0-d device tensor, equal on every rank. They join the step's record
        (`metrics.jsonl`, the log line, the sinks) under these names; the trainer reads them on logging steps only."""
        return {}


class ModelEntry:
    """Base class of a registered model family; subclasses fill in the attributes and `build`."""

    model_id: str = ""
    config_class: type | None = None
    """The HF config class of the family (what its config.json must describe)."""
    model_class: type | None = None
    """The model class `build` returns (for HF families, `TrainingForwardMixin` + the HF class)."""
    fsdp_modules: tuple[str, ...] = ()
    """Default `parallel.fsdp_plan.apply_modules`: each matched module becomes one FSDP2 group."""
    recompute_modules: tuple[str, ...] = ()
    """Default activation-checkpointing patterns."""
    vision_modules: tuple[str, ...] = ()
    """Modules on the vision side: replicated over context parallel, run on whole images."""
    expert_modules: tuple[str, ...] = ()
    """MoE families: the modules holding the stacked expert weights (`[E, ...]`), what expert parallel shards;
    empty for a dense model. Their training forward also returns `outputs.router_load` (`mmfsdp.model.router`)."""
    router_modules: tuple[str, ...] = ()
    """MoE families: the routers (replicated over expert parallel)."""
    capabilities: Capabilities = Capabilities()
    """What the family supports (context parallel, packing, expert layout, video); off unless declared."""
    data: DataNames = DataNames()
    """The templates, image plugins and collators (registry names of `mmfsdp.data`) that fit the family."""

    @property
    def decoder_name(self) -> str:
        """The text decoder module (the model class's `decoder_name`)."""
        return getattr(self.model_class, "decoder_name", "model.language_model")

    @property
    def lm_head_name(self) -> str:
        """The output projection that receives the loss function under chunk loss (the model class's `lm_head_name`)."""
        return getattr(self.model_class, "lm_head_name", "lm_head")

    def build(self, model_cfg: Any, features_cfg: Any = None, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
        raise NotImplementedError

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        raise NotImplementedError

    def validate_parallel(self, model_cfg: Any, plan: Any) -> None:
        """Checks of the parallel layout (`mmfsdp.parallel.MeshPlan`) against the model's config, before any
        process group; raise `ConfigError`. The default refuses what `capabilities` does not declare: context
        parallel, and expert parallel without an expert layout (a dense family) or with one `mmfsdp.parallel`
        does not know."""
        cp_sizes = (("parallel.ulysses_parallel_size", plan.ulysses), ("parallel.ring_attention_size", plan.ring))
        for key, size in cp_sizes:
            if size > 1 and not self.capabilities.context_parallel:
                raise ConfigError(
                    key,
                    f"{size} needs context parallel, which model_id {self.model_id!r} does not support "
                    "(its entry does not declare capabilities.context_parallel); set it to 1",
                )
        if getattr(plan, "ep", 1) <= 1:
            return
        layout = self.capabilities.expert_layout
        if layout is None:
            raise ConfigError(
                "parallel.expert_parallel_size",
                f"{plan.ep} needs a mixture-of-experts model, but model_id {self.model_id!r} is dense (no experts to "
                "split); set it to 1",
            )
        from mmfsdp.parallel.expert_parallel import EXPERT_LAYOUTS

        if layout not in EXPERT_LAYOUTS:
            raise ConfigError(
                "parallel.expert_parallel_size",
                f"{plan.ep}: model_id {self.model_id!r} declares expert layout {layout!r}, which expert parallel "
                f"cannot split (it knows {', '.join(EXPERT_LAYOUTS)}); set it to 1",
            )

    def check_data(
        self,
        *,
        template: str | None,
        image_plugin: str | None,
        collator: str | None,
        packing: bool,
        videos: bool = False,
        padding_free: bool = False,
    ) -> list[ConfigError]:
        """The data choices of a config against the family's declarations: each of template, image plugin (the
        configured one, or the template's default) and collator must be one the family lists in `data` (None:
        not checked), packing and padding-free micro-batches need `capabilities.packing` and a video column
        (`videos`) `capabilities.video`.
        One `ConfigError` per problem, naming the key."""
        pre = "data.dataset_param.preprocess_parameters"
        errors = []
        for key, kind, name, field in (
            (f"{pre}.template", "template", template, "templates"),
            (f"{pre}.image_plugin", "image plugin", image_plugin, "image_plugins"),
            ("data.dataloader_param.collate_param.model_name", "collator", collator, "collators"),
        ):
            names = getattr(self.data, field)
            if name is not None and name not in names:
                fits = f"set it to {' or '.join(map(repr, names))}" if names else f"its entry lists no {field}"
                errors.append(ConfigError(key, f"{kind} {name!r} is not for model_id {self.model_id!r}; {fits}"))
        if packing and not self.capabilities.packing:
            errors.append(ConfigError(
                "data.dataset_param.basic_parameters.packing",
                f"true, but model_id {self.model_id!r} does not support packed rows (its entry does not declare "
                "capabilities.packing); set it to false",
            ))
        if padding_free and not packing and not self.capabilities.packing:
            errors.append(ConfigError(
                "data.dataloader_param.padding_free",
                f"true, but model_id {self.model_id!r} does not support packed rows (its entry does not declare "
                "capabilities.packing), which padding-free micro-batches are; set it to false or leave it null",
            ))
        if videos and not self.capabilities.video:
            errors.append(ConfigError(
                "data.dataset_param.attr.videos",
                f"is set, but model_id {self.model_id!r} takes no video input (its entry does not declare "
                "capabilities.video); set it to null and drop the video rows",
            ))
        return errors

    def step_terms(self, loss_cfg: Any) -> StepTerms:
        """A fresh `StepTerms` for one optimizer step: the family's extra loss terms and step statistics (e.g. a MoE
        family's router load-balancing loss and expert load). `loss_cfg`: `features.loss_cfg`. Default: none."""
        return StepTerms()

    def state_dict_adapter(self) -> Any:
        """The family's `mmfsdp.ckpt.StateDictAdapter` (HF file names and layouts <-> `state_dict()`): by default
        the one an installed package declares under this model id (entry-point group `mmfsdp.state_dict_adapters`);
        a family defined outside an installed package returns its own."""
        from mmfsdp.ckpt.adapters import get_state_dict_adapter

        return get_state_dict_adapter(self.model_id)

    def test_batch(self, config: Any, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """For tests (the family contract test): a collated batch for the tiny `config` — rows of different
        lengths with right padding and `labels`; with `images`, images of different sizes in some rows and none
        in others; without, no vision input at all."""
        raise NotImplementedError(f"model_id {self.model_id!r} has no test_batch")

    def num_experts(self, config: Any) -> int | None:
        """Experts per MoE layer in the HF `config`; None for a dense family."""
        return None

    def expert_parallel_patterns(self, parallel_cfg: Any) -> tuple[str, tuple[str, ...]]:
        """(config key, patterns) of the experts modules expert parallel shards: `parallel.ep_plan.apply_modules`,
        or the family's `expert_modules`."""
        key = "parallel.ep_plan.apply_modules"
        if parallel_cfg.ep_plan.apply_modules is not None:
            return key, tuple(parallel_cfg.ep_plan.apply_modules)
        return f"{key} (model default)", tuple(self.expert_modules)

    def decoder_values_per_token(self, text_config: Any) -> float:
        """Values one decoder layer saves for backward per token, in units of `hidden_size` (the memory plan).

        The default is a pre-norm decoder layer with grouped-query attention and a gated MLP (Mistral, Qwen3):
        attention keeps the layer input and its norm, q, rotated q, the attention output and o_proj's input
        (8 hidden-sized with the MLP's residual, norm and down input), k, rotated k and v (3 KV-sized), and the
        MLP gate, up, silu(gate) and their product plus one more (5 MLP-sized); flash/SDPA keep no scores.
        """
        hidden = text_config.hidden_size
        head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
        kv = text_config.num_key_value_heads * head_dim
        return 8 + 3 * kv / hidden + 5 * text_config.intermediate_size / hidden

    def flop_shape(self, config: Any) -> Any:
        """The model's towers in the numbers FLOP counting needs (`mmfsdp.model.flops.FlopShape`, for MFU): the
        decoder from `config.text_config` (grouped-query attention, `decoder_mlp_params`, `lm_head`) and the vision
        tower from `vision_flops`."""
        from mmfsdp.model.flops import FlopShape, gated_decoder

        text_config = config.text_config
        return FlopShape(decoder=gated_decoder(text_config, self.decoder_mlp_params(text_config)),
                         vision=self.vision_flops(config))

    def decoder_mlp_params(self, text_config: Any) -> int:
        """Matmul weights of the decoder's MLPs one token passes through, all layers together: by default a gated MLP
        (gate, up, down) of `intermediate_size` in every layer. MoE families count the router and top-k experts."""
        return text_config.num_hidden_layers * 3 * text_config.hidden_size * text_config.intermediate_size

    def vision_flops(self, config: Any) -> Any:
        """The vision tower and projector for FLOP counting (`mmfsdp.model.flops.TowerFlops`); None: not counted
        (a text-only family). Families with a vision tower describe it."""
        return None

    def image_patches(self, config: Any, batch: dict[str, Any]) -> list[int]:
        """Vision-tower patches of each image of a collated `batch` of the model of HF `config`, in order (FLOP
        counting); [] when it has none."""
        return []

    def vision_patches_per_image_token(self, config: Any) -> int:
        """Vision-tower patches behind one image token of the decoder: the patch merger's `merge²`."""
        merge = getattr(config, "spatial_merge_size", None) or getattr(config.vision_config, "spatial_merge_size", 1)
        return int(merge) ** 2

    def vision_num_layers(self, config: Any) -> int:
        """Blocks of the vision tower (the memory plan): `vision_config.num_hidden_layers`, or `depth` as Qwen-VL
        configs name it (transformers before 5.2x has no alias between the two)."""
        vision = config.vision_config
        for name in ("num_hidden_layers", "depth"):
            value = getattr(vision, name, None)
            if value is not None:
                return int(value)
        raise AttributeError(f"{type(vision).__name__} has neither num_hidden_layers nor depth")

    def compile_patterns(self, features_cfg: Any) -> tuple[str, list[str]]:
        """(config key, patterns) of the blocks `features.compile` compiles: `features.compile_plan.apply_modules`, or
        the family's recompute patterns under its decoder (`decoder_name`): the decoder layers."""
        key = "features.compile_plan.apply_modules"
        if features_cfg.compile_plan.apply_modules is not None:
            return key, list(features_cfg.compile_plan.apply_modules)
        prefix = self.decoder_name + "."
        return f"{key} (model default)", [p for p in self.recompute_modules if p.startswith(prefix)]

    def fsdp_groups(self, parallel_cfg: Any, parallel_dims: Any) -> list[Any]:
        """The FSDP2 groups (`mmfsdp.parallel.FSDPGroup`): by default one, `parallel.fsdp_plan.apply_modules` (or
        `fsdp_modules`) on the FSDP mesh."""
        from mmfsdp.parallel.fsdp import FSDPGroup

        key = "parallel.fsdp_plan.apply_modules"
        if parallel_cfg.fsdp_plan.apply_modules is not None:
            return [FSDPGroup(tuple(parallel_cfg.fsdp_plan.apply_modules), parallel_dims.fsdp_mesh, key)]
        return [FSDPGroup(tuple(self.fsdp_modules), parallel_dims.fsdp_mesh, f"{key} (model default)")]

    def parallelize(self, model: nn.Module, parallel_cfg: Any, parallel_dims: Any, features_cfg: Any = None) -> nn.Module:
        """Expert parallel (MoE families), `torch.compile` per block (`features.compile`), checkpointing
        (`parallel.recompute`), activation offload, then FSDP2 over
        `fsdp_groups` with the root on the FSDP mesh; in place, on the unsharded model (CPU or meta), before the
        weights are loaded.

        Expert parallel: the experts modules are sharded over the `ep` mesh and run through
        `mmfsdp.parallel.experts_forward` (also at EP 1); with EP > 1 they form their own FSDP2 group on the
        expert FSDP mesh (`mmfsdp.parallel.expert_parallel`)."""
        from mmfsdp.parallel import (
            FSDPGroup, apply_activation_checkpointing, apply_activation_offload, apply_expert_parallel, apply_fsdp_groups,
        )

        groups = self.fsdp_groups(parallel_cfg, parallel_dims)
        if self.expert_modules or getattr(parallel_dims, "ep_size", 1) > 1:
            key, patterns = self.expert_parallel_patterns(parallel_cfg)
            ep_mesh = getattr(parallel_dims, "ep_mesh", None)
            names = apply_expert_parallel(model, patterns, ep_mesh, key=key)
            if ep_mesh is not None:
                groups = [FSDPGroup(tuple(names), parallel_dims.expert_fsdp_mesh, key), *groups]
        if features_cfg is not None and features_cfg.compile:
            from mmfsdp.parallel.compile import apply_compile

            key, patterns = self.compile_patterns(features_cfg)
            plan = features_cfg.compile_plan
            apply_compile(model, patterns, backend=plan.backend, dynamic=plan.dynamic, key=key)
        if parallel_cfg.recompute:
            apply_activation_checkpointing(model, list(parallel_cfg.recompute_plan.apply_modules or self.recompute_modules))
        offload_modules = [] if features_cfg is None else features_cfg.activation_offload_plan.apply_modules
        if offload_modules:
            apply_activation_offload(model, offload_modules)
        return apply_fsdp_groups(model, parallel_cfg.fsdp_plan, groups, parallel_dims.fsdp_mesh)


_REGISTRY: Registry[ModelEntry] = Registry("model id", "model.model_id")
E = TypeVar("E", bound=type[ModelEntry])


def register_model(model_id: str) -> Callable[[E], E]:
    """Class decorator: register one instance of the decorated `ModelEntry` subclass under `model_id`."""

    def decorate(cls: E) -> E:
        entry = cls()
        entry.model_id = model_id
        _REGISTRY.register(model_id, entry)
        return cls

    return decorate


FAMILY_ENTRY_POINT_GROUP = "mmfsdp.model_families"
"""Entry-point group declaring families: name = model id, value = the module whose import registers it."""


def _declared_families() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {point.name: point for point in entry_points(group=FAMILY_ENTRY_POINT_GROUP)}


def registered_model_ids() -> list[str]:
    """Every model id: the registered ones and those a package declares (their modules are not imported)."""
    return sorted(set(_REGISTRY.names()) | set(_declared_families()))


def _load_family(model_id: str) -> None:
    point = _declared_families().get(model_id)
    if point is None or model_id in _REGISTRY:
        return
    point.load()  # the module's @register_model runs on import
    if model_id not in _REGISTRY:
        raise RuntimeError(f"entry point {point.value!r} of group {FAMILY_ENTRY_POINT_GROUP} did not register {model_id!r}")


def load_all_families() -> None:
    """Import every family a package declares (e.g. once in a process that forks workers)."""
    for model_id in _declared_families():
        _load_family(model_id)


def get_model_entry(model_id: str) -> ModelEntry:
    """The entry registered under `model_id`, importing its family on first use; an unknown id is a
    `ConfigError` naming the closest one."""
    if model_id not in _REGISTRY:
        _load_family(model_id)
    if model_id not in _REGISTRY:
        for declared in _declared_families():
            _load_family(declared)
    return _REGISTRY.get(model_id)
