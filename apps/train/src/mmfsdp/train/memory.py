"""The memory plan: what one rank holds on its device for a config, from `config.json` alone.

`memory_plan(cfg, world_size)` builds the model on the meta device through the
trainer's own path (the family's `build`, then `Trainable.prepare`: `training.lora`, `model.freeze`), so no
weights are read and no memory is used, and estimates per rank (docs/memory.md has the formulas and
Magistral-Small-2509 worked through):

- parameters: the master copy in `model.dtype`, sharded by FSDP2 over its shard group
  (`fully_shard` = data-parallel shards × context parallel); on the host with
  `parallel.fsdp_plan.cpu_offload`;
- gradients: trainable parameters only, in their dtype (LoRA adapters: fp32), same sharding;
- optimizer states: AdamW's two fp32 moments per trainable parameter, sharded; 0 on the
  device for `training.optimizer: adamw_swap` (they live in pinned host memory; the bucket
  streamed through the device during `step()` is transient and not counted);
- compute copies: FSDP2 all-gathers each wrapped unit in `param_dtype` (or the storage
  dtype); the largest unit × 2, for the one computing and the one being prefetched;
- activations: tokens per micro-batch and CP rank (`micro_batch_size × cutoff_len /
  (ring × ulysses)`; with a token budget `training.micro_batch_tokens` the micro-batch holds at most
  `max(micro_batch_tokens, cutoff_len)` tokens — a sample over the budget runs alone — and at most the
  rank's step, `micro_batch_size × gradient_accumulation_steps × cutoff_len`) × hidden × layers × the
  family's bytes per token, hidden unit and layer (`FamilyCosts.decoder_values_per_token`, the spec's
  `costs`); recompute keeps only each layer's input plus one layer being recomputed, offload moves the saved
  tensors of the matched layers to the host (one layer in flight); the logits (or one chunk of them with chunk
  loss) come on top, and the vision tower's on the micro-batch's image tokens (or the audio tower's on its audio
  tokens, whichever is more: `FamilyCosts.audio_values_per_token`). A frozen tower saves nothing.
- the stage (`training.stage`, its objective class in `mmfsdp.train.objective`): a sample of `micro_batch_size`
  brings `sequences_per_sample` sequences (DPO: a pair, two), and the models the stage holds beside the policy add
  their `memory_terms` (DPO with the live frozen reference: the copy's parameter shards, the master copy / shard
  group, no gradients or moments; with LoRA, adapters off, or `training.dpo.precompute_ref_logps`: none).

`memory_plan_lines` formats it for `apps/train --check` and, when the total does not fit
the device memory (detected, or `--device-memory`), lists which single changes would fit.

Videos (a config that reads a `videos` column): `video_token_budget` bounds the decoder tokens of
one video from the data settings alone — `video_maxlen` frames (null: the video processor's
`max_frames`) in temporal patches of `temporal_patch_size`, each frame at most `video_max_pixels`
(and at most its share of `video_total_pixels`), one token per `(patch_size · merge)²` pixels of a
patch, plus each temporal patch's timestamp and vision start/end — and `--check` prints it next to `cutoff_len`: the
activations above count those tokens like image tokens (the vision tower runs per temporal patch as
per image), and a video that could outgrow `cutoff_len` is named before the run, not found as a
`too_long` row in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from mmfsdp.config import ConfigError
from mmfsdp.model.parallelize import fsdp_patterns
from mmfsdp.parallel.dtypes import DTYPES
from mmfsdp.train.config import Config, check_world
from mmfsdp.train.objective import MemoryTerm
from mmfsdp.train.stages import objective_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmfsdp.model import ModelEntry
    from mmfsdp.parallel import MeshPlan

__all__ = ["MemoryPlan", "VideoBudget", "memory_plan", "memory_plan_lines", "video_token_budget"]

GiB = 2**30


@dataclass(slots=True)
class MemoryPlan:
    """Bytes per rank on the device (and the host part of adamw_swap / cpu_offload)."""

    world_size: int
    shard_size: int
    num_params: int
    num_trainable: int
    parameters: int
    gradients: int
    optimizer_states: int
    compute_copies: int
    activations: int
    host: int
    device_memory: int | None
    stage_terms: list[MemoryTerm] = dataclasses.field(default_factory=list)
    """The models the stage holds beside the policy, on the device (`Objective.memory_terms`)."""
    suggestions: list[str] = dataclasses.field(default_factory=list)

    @property
    def reference(self) -> int:
        """The stage's reference model (DPO's frozen copy: parameter shards), 0 without one on the device."""
        return sum(term.bytes for term in self.stage_terms if term.name == "reference")

    @property
    def before_activations(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + sum(
            term.bytes for term in self.stage_terms if term.phase == "step")

    @property
    def generation(self) -> int:
        """What only the stage's generation holds (a rollout's KV cache), alive before the training forwards."""
        return sum(term.bytes for term in self.stage_terms if term.phase == "generation")

    @property
    def total(self) -> int:
        return self.before_activations + self.compute_copies + max(self.activations, self.generation)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory


def _detected_device_memory() -> int | None:
    from mmfsdp.parallel import detect_device_type

    device_type = detect_device_type()
    if device_type == "cpu":
        return None
    return int(getattr(torch, device_type).get_device_properties(0).total_memory)


def _build_meta(cfg: Config) -> tuple[torch.nn.Module, ModelEntry]:
    """The model on the meta device as the trainer prepares it (`Trainable.prepare`: LoRA adapters, frozen modules)."""
    from mmfsdp.model import get_model_entry
    from mmfsdp.train.trainable import Trainable

    entry = get_model_entry(cfg.model.model_id)
    model = entry.build(cfg.model, cfg.features, device=torch.device("meta"))
    Trainable(cfg.training.lora, freeze=cfg.model.freeze, entry=entry, seed=cfg.training.seed).prepare(model)
    return model, entry


def _largest_unit(model: torch.nn.Module, patterns: list[str]) -> int:
    """Parameters of the largest FSDP2 unit: a wrapped module less its wrapped children, or the root's rest."""
    from mmfsdp.parallel.patterns import match_module_names

    names = match_module_names(model, patterns, key="parallel.fsdp_plan.apply_modules")
    owner: dict[int, str] = {}
    for name in sorted(names, key=len):  # inner units are longer names: they take their parameters last
        for param in model.get_submodule(name).parameters():
            owner[id(param)] = name
    sizes: dict[str, int] = {}
    for param in model.parameters():
        unit = owner.get(id(param), "")
        sizes[unit] = sizes.get(unit, 0) + param.numel()
    return max(sizes.values(), default=0)


def micro_batch_tokens(cfg: Config) -> int:
    """The most tokens (rows × row length, padding included) one micro-batch of a rank holds (module docstring)."""
    t = cfg.training
    sequences, length = objective_class(t.stage).sequence_shape(cfg)  # each sample: sequences of up to length tokens
    if t.micro_batch_tokens is None:
        return sequences * t.micro_batch_size * length
    return min(max(t.micro_batch_tokens, sequences * length),
               sequences * t.micro_batch_size * t.gradient_accumulation_steps * length)


def _activations(
    cfg: Config, model: torch.nn.Module, entry: ModelEntry, plan: MeshPlan, image_token_share: float
) -> int:
    text = model.config.text_config
    compute = DTYPES[cfg.parallel.fsdp_plan.param_dtype or cfg.model.dtype].itemsize
    tokens = micro_batch_tokens(cfg) // (plan.ring * plan.ulysses)
    per_layer = tokens * text.hidden_size * entry.costs.decoder_values_per_token(text) * compute
    layer_input = tokens * text.hidden_size * compute
    layers = text.num_hidden_layers
    recompute = cfg.parallel.recompute
    offload = bool(cfg.features.activation_offload_plan.apply_modules)
    if recompute and offload:
        decoder = layer_input + per_layer
    elif recompute:
        decoder = layers * layer_input + per_layer
    elif offload:
        decoder = per_layer  # the one layer whose saved tensors are back on the device for backward
    else:
        decoder = layers * per_layer
    if cfg.features.enable_chunk_loss:
        logits = min(cfg.features.chunkloss_plan.chunk_size, tokens) * text.vocab_size * 4 * 2
    else:
        logits = tokens * text.vocab_size * (compute + 4 + 4)  # the logits, their fp32 copy and its gradient
    vision = 0
    vision_tower = model.get_submodule(entry.vision_modules[0]) if entry.vision_modules else None
    if vision_tower is not None and any(p.requires_grad for p in vision_tower.parameters()):
        vis = model.config.vision_config
        patches = tokens * image_token_share * entry.costs.vision_patches_per_image_token(model.config)
        vision_layer = patches * vis.hidden_size * (8 + 5 * vis.intermediate_size / vis.hidden_size) * compute
        vision_input = patches * vis.hidden_size * compute
        depth = entry.costs.vision_num_layers(model.config)
        vision = depth * vision_input + vision_layer if recompute else depth * vision_layer
    audio, audio_tower = 0, entry.costs.audio_tower
    if audio_tower and any(p.requires_grad for p in model.get_submodule(audio_tower).parameters()):
        per_token = entry.costs.audio_values_per_token(model.config, recompute=recompute)
        audio = tokens * image_token_share * per_token * compute
    # a token of a micro-batch is an image token or an audio token, not both: the worse of the two towers
    return int(decoder + logits + max(vision, audio))


_TIMESTAMP_TOKENS = 8
"""Text tokens around one temporal patch besides its pads, at most: `<12.3 seconds>` and the vision start/end."""


@dataclass(frozen=True, slots=True)
class VideoBudget:
    """The most decoder tokens one video can take under the data settings (`video_token_budget`)."""

    num_frames: int
    """Frames sampled at most (`video_maxlen`, rounded up to whole temporal patches)."""
    num_temporal_patches: int
    frame_pixels: int | None
    """Pixels of one frame at most (`video_max_pixels`, or its share of `video_total_pixels`); None: no limit."""
    tokens: int | None
    """Tokens of one video at most, about (pads + timestamps); None: no pixel limit in the config."""


def video_token_budget(
    cfg: Config, model_config: PretrainedConfig, max_frames: int | None = None
) -> VideoBudget | None:
    """The token bound of one video (module docstring) for a config that reads videos; None when it reads none.
    `max_frames` stands for `video_maxlen` where the config leaves it null (the video processor's `max_frames`)."""
    if cfg.data.dataset_param.attr.videos is None:
        return None
    pp = cfg.data.dataset_param.preprocess_parameters
    vision = model_config.vision_config
    temporal = int(getattr(vision, "temporal_patch_size", 1) or 1)
    cell = int(vision.patch_size) * int(getattr(vision, "spatial_merge_size", 1) or 1)
    groups = -(-(pp.video_maxlen or max_frames) // temporal)
    frames = groups * temporal
    limits = [limit for limit in (pp.video_max_pixels, pp.video_total_pixels and pp.video_total_pixels // frames)
              if limit]
    if not limits:
        return VideoBudget(num_frames=frames, num_temporal_patches=groups, frame_pixels=None, tokens=None)
    frame_pixels = max(min(limits), cell * cell)
    cells = -(-frame_pixels // (cell * cell))  # the resize rounds each side to whole cells: about this many
    return VideoBudget(
        num_frames=frames, num_temporal_patches=groups, frame_pixels=frame_pixels,
        tokens=groups * (cells + _TIMESTAMP_TOKENS),
    )


def _video_lines(cfg: Config) -> list[str]:
    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(cfg.model.model_name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return []
    if not hasattr(model_config, "vision_config"):
        return []
    max_frames = None
    pp = cfg.data.dataset_param.preprocess_parameters
    if cfg.data.dataset_param.attr.videos is not None and pp.video_maxlen is None:
        from mmfsdp.data import DataError, media_settings

        try:
            max_frames = next(s.value for s in media_settings(cfg.data) if s.key == "video_maxlen")
        except (ConfigError, DataError, OSError, ValueError, StopIteration):
            return []
    budget = video_token_budget(cfg, model_config, max_frames)
    if budget is None:
        return []
    cutoff = cfg.data.dataset_param.preprocess_parameters.cutoff_len
    if budget.tokens is None:
        return [
            f"  video tokens      no bound: video_maxlen {budget.num_frames} frames, but neither video_max_pixels nor "
            "video_total_pixels is set; the video processor's own size limit applies (mm-data stats shows the "
            "real counts)"
        ]
    lines = [
        f"  video tokens      ~<= {budget.tokens} per video ({budget.num_temporal_patches} temporal patches of "
        f"<= {budget.frame_pixels} px per frame, video_maxlen {budget.num_frames}); cutoff_len {cutoff}"
    ]
    if budget.tokens > cutoff:
        lines.append(
            f"  video budget: one video may take {budget.tokens} tokens > cutoff_len {cutoff}: such rows are "
            "skipped as too_long (lower video_max_pixels / video_maxlen, set video_total_pixels, or raise cutoff_len)"
        )
    return lines


def memory_plan(cfg: Config, world_size: int, device_memory_bytes: int | None = None, *,
                image_token_share: float = 1.0, _suggest: bool = True,
                _meta: tuple[torch.nn.Module, ModelEntry] | None = None) -> MemoryPlan:
    """The per-rank memory plan of `cfg` on `world_size` processes (meta build: reads only config.json).

    `image_token_share` is the part of a micro-batch's tokens that are image tokens (or audio tokens), which sets
    the vision tower's patches (and the audio tower's positions); 1.0, the default, is the worst case (a
    micro-batch of image tokens only, or of audio tokens only where that costs more)."""
    if not 0.0 <= image_token_share <= 1.0:
        raise ValueError(f"image_token_share must be within [0, 1], got {image_token_share}")
    mesh = check_world(cfg, world_size)
    model, entry = _meta or _build_meta(cfg)
    shard = mesh.fully_shard
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters()) // shard  # model.dtype; adapters fp32
    gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) // shard
    moments = 2 * 4 * num_trainable // shard
    host = 0
    stage_terms = objective_class(cfg.training.stage).memory_terms(cfg, model, shard)
    if cfg.training.optimizer == "adamw_swap":
        host += moments
        moments = 0
    if cfg.parallel.fsdp_plan.cpu_offload:
        host += parameters + gradients + moments + sum(term.bytes for term in stage_terms if term.phase == "step")
        parameters = gradients = moments = 0
        stage_terms = [term for term in stage_terms if term.phase != "step"]  # a KV cache stays on the device
    patterns = list(fsdp_patterns(entry, cfg.parallel)[1]) or list(entry.fsdp_modules)
    compute = DTYPES[cfg.parallel.fsdp_plan.param_dtype or cfg.model.dtype].itemsize
    copies = 2 * _largest_unit(model, patterns) * compute
    activations = _activations(cfg, model, entry, mesh, image_token_share)
    if device_memory_bytes is None:
        device_memory_bytes = _detected_device_memory()
    plan = MemoryPlan(
        world_size=world_size, shard_size=shard, num_params=num_params, num_trainable=num_trainable,
        parameters=parameters, gradients=gradients, optimizer_states=moments, compute_copies=copies,
        activations=activations, host=host, device_memory=device_memory_bytes, stage_terms=stage_terms,
    )
    if _suggest and plan.fits is False:
        plan.suggestions = _suggestions(cfg, plan, image_token_share, (model, entry))
    return plan


def _suggestions(cfg: Config, current: MemoryPlan, image_token_share: float,
                 meta: tuple[torch.nn.Module, ModelEntry]) -> list[str]:
    """Single changes under which `cfg`'s plan (`current`, with its meta model `meta`) fits its device memory, in the
    order a user would try them. A change that leaves the model and its adapters as they are is planned on `meta`."""
    world_size, device_memory = current.world_size, current.device_memory
    p, f, t = cfg.parallel, cfg.features, cfg.training
    layers = [f"{(cfg.parallel.recompute_plan.apply_modules or ['model.language_model.layers.{*}'])[0]}"]
    candidates: list[tuple[str, Config, int]] = [
        ("parallel.recompute: true", replace(cfg, parallel=replace(p, recompute=True)), world_size),
        ("training.optimizer: adamw_swap", replace(cfg, training=replace(t, optimizer="adamw_swap")), world_size),
        (f"features.activation_offload_plan.apply_modules: [{layers[0]}]",
         replace(cfg, features=replace(f, activation_offload_plan=replace(f.activation_offload_plan, apply_modules=layers))),
         world_size),
        ("features.enable_chunk_loss: true", replace(cfg, features=replace(f, enable_chunk_loss=True)), world_size),
        *((text, changed, world_size) for text, changed in objective_class(t.stage).memory_savings(cfg)),
        ("training.micro_batch_size: 1", replace(cfg, training=replace(t, micro_batch_size=1)), world_size)
        if t.micro_batch_tokens is None else
        (f"training.micro_batch_tokens: {cfg.data.dataset_param.preprocess_parameters.cutoff_len}",
         replace(cfg, training=replace(t, micro_batch_tokens=cfg.data.dataset_param.preprocess_parameters.cutoff_len)),
         world_size),
        (f"{2 * world_size} processes", cfg, 2 * world_size),
        ("parallel.fsdp_plan.cpu_offload: true",
         replace(cfg, parallel=replace(p, fsdp_plan=replace(p.fsdp_plan, cpu_offload=True))), world_size),
    ]
    fitting = []
    for text, changed, size in candidates:
        if changed is cfg and size == world_size:
            continue
        same_model = changed.model is cfg.model and changed.training.lora is cfg.training.lora
        try:
            plan = memory_plan(changed, size, device_memory, image_token_share=image_token_share, _suggest=False,
                               _meta=meta if same_model else None)
        except Exception:  # a change the mesh rules out (e.g. CP sizes) is simply not suggested
            continue
        if plan.fits and plan.total < current.total:
            fitting.append(f"{text} ({plan.total / GiB:.1f} GiB)")
    return fitting


def memory_plan_lines(cfg: Config, world_size: int, device_memory_bytes: int | None = None, *,
                      image_token_share: float = 1.0) -> list[str]:
    """The plan as the lines `--check` prints."""
    plan = memory_plan(cfg, world_size, device_memory_bytes, image_token_share=image_token_share)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    lines = [
        f"memory plan per rank ({world_size} processes, FSDP shard group {plan.shard_size}; "
        f"{plan.num_params / 1e9:.2f} B parameters, {plan.num_trainable / 1e9:.2f} B trainable; docs/memory.md):",
        f"  parameters        {gib(plan.parameters):>10}  ({cfg.model.dtype} master copy / {plan.shard_size})",
        f"  gradients         {gib(plan.gradients):>10}  (trainable only)",
        f"  optimizer states  {gib(plan.optimizer_states):>10}  "
        + ("(adamw_swap: in host memory)" if cfg.training.optimizer == "adamw_swap" else "(AdamW: 2 x fp32)"),
        *(f"  {term.label:<18}{gib(term.bytes):>10}  ({term.note})" for term in plan.stage_terms
          if term.bytes and term.phase == "step"),
        f"  before activations{gib(plan.before_activations):>10}",
        f"  compute copies    {gib(plan.compute_copies):>10}  (largest FSDP unit gathered x 2)",
        f"  activations       {gib(plan.activations):>10}  (estimate; {micro_batch_tokens(cfg)} tokens per micro-batch"
        + (" under micro_batch_tokens" if cfg.training.micro_batch_tokens is not None else "")
        + f", image tokens {image_token_share:.0%} of them)",
        *(f"  {term.label:<18}{gib(term.bytes):>10}  ({term.note}; before the training forwards: the larger of it "
          "and the activations counts)" for term in plan.stage_terms if term.bytes and term.phase == "generation"),
        f"  total             {gib(plan.total):>10}" + (f"  (+ {gib(plan.host)} in host memory)" if plan.host else ""),
        *_video_lines(cfg),
    ]
    if plan.device_memory is None:
        lines.append("  device memory: not detected; pass --device-memory SIZE (e.g. 64GiB) to compare")
    elif plan.fits:
        lines.append(f"  fits: {gib(plan.total)} of {gib(plan.device_memory)} device memory")
    else:
        lines.append(f"  does not fit: {gib(plan.total)} > {gib(plan.device_memory)} device memory")
        lines.append("  would fit with: " + ("; ".join(plan.suggestions) if plan.suggestions else "none of one change; combine them"))
    return lines
