"""The one YAML: six sections composed from the packages that own them.

`parallel`, `model`, `features` and `data` are defined by their packages;
`training` and `tools` belong to the trainer and live here. `load_config`
reads the file, translates the keys of MindSpeed-MM's schema into ours (each
section's `foreign_keys`, `mmfsdp.config.foreign`), applies dotted overrides in
either spelling, builds every section strictly and then runs the checks that span
sections and the world size — all before any process group exists, so a user's
mistake is one line naming the key, never a traceback from rank 3.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from mmfsdp.config import (
    Alias, ConfigError, ConfigErrors, ForeignKey, Ignored, Translated, build, dump_yaml, get_logger, load_translated, warn_once,
)
from mmfsdp.data import DataConfig, has_eval_data
from mmfsdp.model import FeaturesConfig, LoraConfig, ModelConfig, get_model_entry
from mmfsdp.parallel import MeshPlan, ParallelConfig
from mmfsdp.parallel.cp import validate_sequence_multiple
from mmfsdp.train.stage_config import DPOConfig, GRPOConfig
from mmfsdp.train.stages import STAGE_NAMES, objective_class


def detect_load_format(load: str | None) -> Literal["dcp", "hf"]:
    """`load_format: auto` (MindSpeed-MM's): an HF directory holds config.json and safetensors weights; anything
    else (a DCP checkpoint, its tracker file, a path that does not exist yet) is read as DCP, whose checks then say
    what is missing."""
    path = Path(load) if load else None
    if path is not None and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf"
    return "dcp"


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    stage: Literal[STAGE_NAMES] = "sft"
    """What a step minimises: sft (cross-entropy of the answers) or dpo (a preference loss on chosen/rejected pairs, `training.dpo`; the data is read as pairs: `data.dataset_param.attr.ranking` is set true) or grpo (online RL: completions generated each step and scored by reward functions, `training.grpo`; the data is read as prompts: `data.dataset_param.attr.prompt_only` is set true). LLaMA-Factory's `stage`."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference training (`stage: dpo`): loss, β, the SFT term and the reference (docs/preference.md)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Online RL (`stage: grpo`): generation, rewards, the clipped policy loss (docs/rl.md)."""
    lr: float = 1.0e-5
    """Peak learning rate (reached at the end of warm-up)."""
    lr_min: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    """Shape of the decay after warm-up."""
    lr_warmup_ratio: float = 0.0
    """Fraction of `train_iters` spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""
    optimizer: Literal["adamw", "adamw_swap"] = "adamw"
    """Optimizer; AdamW uses torch's fused kernel (CUDA, NPU and the CPU: one pass over the states, about 4x faster than foreach on the CPU); adamw_swap is the same AdamW with its moments in pinned host memory, streamed to the device in buckets for the update (docs/parallelism.md)."""
    swap_optimizer_times: int = 16
    """adamw_swap: number of buckets the optimizer state streams through the device in per step (more buckets: less device memory, more copies)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1.0e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step. With `micro_batch_tokens` it only sizes the step: dp_size × micro_batch_size × gradient_accumulation_steps samples."""
    micro_batch_tokens: int | None = None
    """Token budget of one micro-batch (padded rows, or the packed row, plus images' vision work in token equivalents); each optimizer step keeps dp_size × micro_batch_size × gradient_accumulation_steps samples, split into as many micro-batches as the budget needs, the same number on every rank (docs/data.md#token-budget-and-balance). null: micro_batch_size samples per micro-batch."""
    train_iters: int = 100
    """Number of optimizer steps."""
    seed: int = 1234
    """Seed for model init, data order and dropout; the same seed gives the same run."""
    init_model_with_meta_device: bool = False
    """Build the model on the meta device, shard it, then materialise and fill it from the resume checkpoint or the initial weights (`load`, or `model.model_name_or_path`)."""
    load: str | None = None
    """Initial weights (an HF directory with `load_format: hf`, or a DCP `release`) or a checkpoint to resume from; a checkpoint in `save` takes precedence (docs/checkpoints.md)."""
    load_format: Literal["dcp", "hf", "auto"] = "dcp"
    """Format of `load`: a DCP checkpoint directory, or HF safetensors loaded straight into the sharded model; auto = hf when the directory holds config.json and safetensors, else dcp (decided when the config is read)."""
    save: str | None = None
    """Directory for DCP checkpoints (`iter_0000100/` and the tracker file); a run resumes from the checkpoint found here."""
    save_interval: int = 0
    """Save every N steps (0: only at the end when `save` is set)."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints."""
    save_async: bool = False
    """Write checkpoints in the background with DCP async save."""
    no_save_optim: bool = False
    """Do not save the optimizer state."""
    no_load_optim: bool = False
    """Do not load the optimizer state on resume."""
    no_load_rng: bool = False
    """Do not restore RNG states on resume."""
    resume_fallback: bool = False
    """When the checkpoint to resume from is damaged, resume from the newest whole older one instead of stopping."""
    log_interval: int = 1
    """Log a line and a metrics record every N steps; only these steps (and saves) wait for the device, and there a NaN/inf loss of any step since the last check stops the run."""
    output_dir: str = "outputs/run"
    """Where `config.yaml`, `metrics.jsonl` and `eval.json` are written."""
    eval_batch_size: int = 8
    """Samples per rank per forward pass during the final evaluation and the periodic validation."""
    val_interval: int = 0
    """Every N steps, the mean loss per trained token over the evaluation data (`val_loss` in the log line and metrics.jsonl); 0 = off. Needs evaluation data (`basic_parameters.eval_dataset`). With `stage: grpo` also the held-out greedy reward (`val_reward`, `val_rewards/<function>/mean`; docs/rl.md)."""
    eval_on_start: bool = False
    """Before step 1 of a run that starts at step 0: the end's held-out evaluation (`eval.json`'s numbers) on the starting weights, logged and written to `<output_dir>/eval_start.json` (HF TrainingArguments' `eval_on_start`): "before" beside `eval.json`'s "after". Needs evaluation data."""
    save_format: Literal["dcp", "hf"] = "dcp"
    """dcp: each save writes the DCP checkpoint (resumable); hf: also exports the model as HF safetensors to `<save>/hf/iter_NNNNNNN`, loadable with `from_pretrained` (config and tokenizer from `model.model_name_or_path`)."""
    deterministic: bool = False
    """Deterministic algorithms only (`torch.use_deterministic_algorithms`; CUBLAS_WORKSPACE_CONFIG on CUDA, HCCL_DETERMINISTIC on NPU): bitwise-repeatable runs, usually slower."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on a frozen model; checkpoints hold the adapters only (docs/model.md, LoRA)."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "use_deter_comp": Alias("training.deterministic"),
        "dyn_bsz": Ignored(
            "VeOmni's switch for token-budget micro-batches; mmfsdp's budget is training.micro_batch_tokens (give it "
            "VeOmni's micro_batch_size × max_seq_len)",
            allowed=(False,),
        ),
        "val_micro_batch_size": Alias("training.eval_batch_size"),
        # preference training: LLaMA-Factory's and MindSpeed-LLM's names
        "pref_beta": Alias("training.dpo.beta"),
        "dpo_beta": Alias("training.dpo.beta"),
        "pref_loss": Alias("training.dpo.loss_type"),
        "dpo_loss_type": Alias("training.dpo.loss_type"),
        "pref_ftx": Alias("training.dpo.rpo_alpha"),
        "dpo_label_smoothing": Alias("training.dpo.label_smoothing"),
        "precompute_ref_log_probs": Alias("training.dpo.precompute_ref_logps"),
        "save_format": Alias(values={"auto": "dcp"}),
        "adam_fused": Ignored("AdamW is always fused (torch's fused kernel, on every device)"),
        "plugin": Ignored("model and dataset code comes from mmfsdp's registered packages, not from paths"),
        "quantization_plan": Ignored("low-precision (MXFP8) training is not implemented; the run computes in the configured dtypes"),
        "no_save_rng": Ignored("RNG states are always saved (a few KB); no_load_rng decides whether a resume restores them"),
        # HF TrainingArguments' names (LLaMA-Factory) and Megatron's (MindSpeed's) for the metrics sinks
        "report_to": Alias("tools.report_to"),
        "logging_dir": Alias("tools.tensorboard_dir"),
        "run_name": Alias("tools.run_name"),
        "tensorboard_dir": Alias("tools.tensorboard_dir"),
        "wandb_project": Alias("tools.wandb_project"),
        "wandb_exp_name": Alias("tools.run_name"),
        "wandb_save_dir": Alias("tools.wandb_dir"),
    }

    def __post_init__(self) -> None:
        for key in ("micro_batch_size", "gradient_accumulation_steps", "train_iters", "log_interval", "eval_batch_size", "swap_optimizer_times"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError("micro_batch_tokens", f"must be >= 1 or null, got {self.micro_batch_tokens}")
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ConfigError("lr", f"must be a positive number, got {self.lr}")
        if not 0.0 <= self.lr_min <= self.lr:
            raise ConfigError("lr_min", f"must be between 0 and lr ({self.lr}), got {self.lr_min}")
        if not 0.0 <= self.lr_warmup_ratio < 1.0:
            raise ConfigError("lr_warmup_ratio", f"must be in [0, 1), got {self.lr_warmup_ratio}")
        if self.clip_grad < 0:
            raise ConfigError("clip_grad", f"must be >= 0, got {self.clip_grad}")
        if self.save_interval < 0:
            raise ConfigError("save_interval", f"must be >= 0, got {self.save_interval}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError("save_total_limit", f"must be >= 1 or null, got {self.save_total_limit}")
        if self.val_interval < 0:
            raise ConfigError("val_interval", f"must be >= 0 (0 turns validation off), got {self.val_interval}")
        if self.load_format == "auto":
            self.load_format = detect_load_format(self.load)


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    enable: bool = False
    """Record a torch.profiler trace."""
    start_step: int = 2
    """First profiled step."""
    end_step: int = 3
    """Last profiled step."""
    output_dir: str | None = None
    """Trace directory (default `<output_dir>/profile`)."""
    ranks: list[int] | None = None
    """Global ranks that record a trace; null = every rank."""
    record_shapes: bool = True
    """Record the input shapes of each operator."""
    with_memory: bool = True
    """Record tensor allocations and frees (`profile_memory`)."""
    with_stack: bool = False
    """Record the Python stack of each operator."""
    with_cpu: bool = True
    """Record CPU activity (the accelerator's activity is always recorded when there is one)."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "profile_type": Ignored("one profiler: torch.profiler over start_step..end_step", allowed=("static",)),
        **{f"static_param.{key}": Alias(f"tools.profile.{key}") for key in ("start_step", "end_step", "record_shapes", "with_memory", "with_stack", "with_cpu")},
        "static_param.save_path": Alias("tools.profile.output_dir"),
        **{f"static_param.{key}": Ignored("an option of Ascend's own profiler; traces come from torch.profiler")
           for key in ("level", "data_simplification", "aic_metrics_type", "analyse_flag")},
    }

    def __post_init__(self) -> None:
        _check_steps(self.enable, self.start_step, self.end_step)


def _check_steps(enable: bool, start_step: int, end_step: int) -> None:
    if enable and not 1 <= start_step <= end_step:
        raise ConfigError("start_step", f"need 1 <= start_step <= end_step, got {start_step}..{end_step}")


@dataclass(kw_only=True, slots=True)
class MemoryProfileConfig:
    enable: bool = False
    """Record every device allocation of steps start_step..end_step on the ranks in `dump_ranks` and write a memory snapshot (`torch.cuda.memory._dump_snapshot`, or NPU's; on a CPU-only host a JSON file of the tensor-memory peak per step)."""
    start_step: int = 1
    """First recorded step."""
    end_step: int = 2
    """Last recorded step; the snapshot is written after it."""
    save_path: str | None = None
    """Snapshot directory (default `<output_dir>/memory_snapshot`); one file per listed rank, `snapshot_rank<r>_steps<a>-<b>.pickle` (`.json` on the CPU)."""
    dump_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that record and write a snapshot."""
    stacks: Literal["python", "all"] = "all"
    """Stack traces kept per allocation: python frames only, or all (C++ too)."""
    max_entries: int | None = None
    """Keep at most this many allocation events (the newest); null = all."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "mem_info": Ignored("the log line already shows each step's peak memory"),
    }

    def __post_init__(self) -> None:
        _check_steps(self.enable, self.start_step, self.end_step)
        if self.max_entries is not None and self.max_entries < 1:
            raise ConfigError("max_entries", f"must be >= 1 or null, got {self.max_entries}")


REPORT_SINKS = ("tensorboard", "wandb")
"""The metrics sinks `tools.report_to` can name (`mmfsdp.train.sinks`)."""


@dataclass(kw_only=True, slots=True)
class ToolsConfig:
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler settings."""
    memory_profile: MemoryProfileConfig = field(default_factory=MemoryProfileConfig)
    """Device memory snapshot settings."""
    report_to: list[str] | str = field(default_factory=list)
    """Where rank 0 also sends every scalar of metrics.jsonl and the resolved config: `tensorboard`, `wandb`, a list
    of them, `all` or `none` (LLaMA-Factory's values); needs the `mmfsdp-train[metrics]` extra."""
    tensorboard_dir: str | None = None
    """TensorBoard event files (default `<output_dir>/tensorboard`); a resumed run hides the steps logged after its
    checkpoint (purge_step)."""
    wandb_dir: str | None = None
    """W&B run files (default `<output_dir>/wandb`); it also holds the run id a resumed run continues. Offline
    unless WANDB_API_KEY is set (or WANDB_MODE says otherwise)."""
    wandb_project: str = "mmfsdp"
    """W&B project name."""
    run_name: str | None = None
    """W&B run name (default: the name of `output_dir`)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; null: from the device table (H100/H200/A100/B200, Ascend 910B/950), or
    on a CPU (or an unknown device) measured once by a GEMM at start."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "logging_dir": Alias("tools.tensorboard_dir"),
    }

    def __post_init__(self) -> None:
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        names = [part.strip() for name in names for part in name.split(",") if part.strip()]
        resolved: list[str] = []
        for name in names:
            if name == "all":
                resolved += REPORT_SINKS
            elif name in REPORT_SINKS:
                resolved.append(name)
            elif name != "none":
                raise ConfigError(
                    "report_to", f"{name!r} is not a metrics sink here; use {', '.join(REPORT_SINKS)}, all or none"
                )
        self.report_to = sorted(set(resolved), key=REPORT_SINKS.index)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError("peak_tflops", f"must be > 0 or null, got {self.peak_tflops}")


@dataclass(kw_only=True, slots=True)
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Devices, mesh, FSDP2 plan, recompute, context parallel."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset, template, image plugin, collator, loader."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model and how to build it."""
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    """Loss features: chunk loss and loss normalisation."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimisation, schedule, checkpoints, logging."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Profiling, memory snapshots, metrics sinks (TensorBoard, W&B) and the MFU peak."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        # a LLaMA-Factory file's top-level keys
        "stage": Alias("training.stage"),
        "pref_beta": Alias("training.dpo.beta"),
        "pref_loss": Alias("training.dpo.loss_type"),
        "pref_ftx": Alias("training.dpo.rpo_alpha"),
        "dpo_label_smoothing": Alias("training.dpo.label_smoothing"),
        "report_to": Alias("tools.report_to"),
        "logging_dir": Alias("tools.tensorboard_dir"),
        "run_name": Alias("tools.run_name"),
    }

    def __post_init__(self) -> None:
        fill_family_data_defaults(self.model.model_id, self.data)
        translate_module_names(self)
        objective_class(self.training.stage).configure(self)


MODULE_LISTS = (
    "parallel.fsdp_plan.apply_modules", "parallel.recompute_plan.apply_modules", "parallel.ep_plan.apply_modules",
    "features.activation_offload_plan.apply_modules", "features.compile_plan.apply_modules", "model.freeze",
    "training.lora.target_modules",
)
"""The configured lists of module names (`translate_module_names`)."""


def translate_module_names(cfg: Config) -> None:
    """Module names of another layout in the configured module lists (`MODULE_LISTS`) rewritten to the model's, by
    the family's `legacy_module_names` (`mmfsdp.model.spec.current_module_name`), each rewrite logged once: so a
    published config written for the seed system's own modeling file (MindSpeed-MM's Qwen3-Omni: `visual.blocks.{*}`,
    `model.layers.{*}`, `audio_tower`) plans, freezes and checks the modules it means."""
    from mmfsdp.config import warn_once
    from mmfsdp.model.spec import current_module_name

    if cfg.model.model_id is None:
        return
    legacy = get_model_entry(cfg.model.model_id).legacy_module_names
    if not legacy:
        return
    for key in MODULE_LISTS:
        *path, last = key.split(".")
        owner = cfg
        for part in path:
            owner = getattr(owner, part)
        names = getattr(owner, last)
        if not names:
            continue
        current = [current_module_name(name, legacy) for name in names]
        for old, new in zip(names, current):
            if old != new:
                warn_once(f"{key}: {old!r} is read as {new!r} (the {cfg.model.model_id} model's name for it)")
        setattr(owner, last, current)


def fill_family_data_defaults(model_id: str | None, data_cfg: DataConfig) -> None:
    """Data choices left null take the model family's defaults: the first template and collator its entry lists
    (the family spec's `data`), and padding-free micro-batches where it packs (`capabilities.packing`). The data
    package names no family (it never sees the model); this is where the two meet.
    A family that lists none leaves them null, and the data package asks for them by key."""
    pre = data_cfg.dataset_param.preprocess_parameters
    loader = data_cfg.dataloader_param
    collate = loader.collate_param
    if model_id is None or (pre.template is not None and collate.model_name is not None
                            and loader.padding_free is not None):
        return
    entry = get_model_entry(model_id)
    if loader.padding_free is None:  # padding-free micro-batches are packed rows: on where the family packs
        loader.padding_free = entry.capabilities.packing
    names = entry.data
    if pre.template is None and names.templates:
        pre.template = names.templates[0]
    if collate.model_name is None and names.collators:
        collate.model_name = names.collators[0]


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, translate, override and build the config; raises `ConfigError` for any user mistake (`ConfigErrors` for several).

    Keys of MindSpeed-MM's schema that mmfsdp ignores are logged once, as one warning line, on rank 0.
    """
    cfg, errors, translated = read_config(path, overrides)
    if errors:
        raise ConfigErrors(errors)
    warn_ignored_keys(translated)
    return cfg


def read_config(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, list[ConfigError], Translated]:
    """The built config, every problem of its values (collected rather than raised), and what was translated.

    A file that cannot be built (unknown key, wrong type, a section's own check)
    still raises its `ConfigError`: there is no config to check further.
    """
    translated = load_translated(Config, path, overrides)
    cfg = build(Config, translated.data, "")
    errors = check_values(cfg)
    try:
        check_sections(cfg)
    except ConfigError as err:
        errors.append(err)
    return cfg, errors, translated


def warn_ignored_keys(translated: Translated) -> None:
    """The one warning line listing every ignored key of another schema and why (once per process, rank 0)."""
    line = translated.warning()
    if line is not None:
        warn_once(line, get_logger("mmfsdp.train"))


SEED_MAX = 2**32 - 1


def _walk_fields(obj, path: str = ""):
    """(key path, value) of every leaf field of a nested config dataclass, lists included."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _walk_fields(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk_fields(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _walk_fields(item, f"{path}.{key}")
    else:
        yield path, obj


def check_values(cfg: Config) -> list[ConfigError]:
    """Value ranges no single field checks: every problem found, not only the first.

    No NaN or infinite number anywhere, seeds in 0 … 2**32 - 1 (what numpy and the
    loaders accept), AdamW's betas in [0, 1), eps > 0, weight decay >= 0, and the
    profiled steps within `training.train_iters`.
    """
    errors: list[ConfigError] = []
    for key, value in _walk_fields(cfg):
        name = key.rsplit(".", 1)[-1]
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(ConfigError(key, f"must be a finite number, got {value}"))
        elif (name == "seed" or name.endswith("_seed")) and isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value <= SEED_MAX:
                errors.append(ConfigError(key, f"must be in 0 ... {SEED_MAX} (2**32 - 1), got {value}"))
    t = cfg.training
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(t, name)
        if math.isfinite(value) and not 0.0 <= value < 1.0:
            errors.append(ConfigError(f"training.{name}", f"must be in [0, 1), got {value}"))
    if math.isfinite(t.adam_eps) and t.adam_eps <= 0:
        errors.append(ConfigError("training.adam_eps", f"must be > 0, got {t.adam_eps}"))
    if math.isfinite(t.weight_decay) and t.weight_decay < 0:
        errors.append(ConfigError("training.weight_decay", f"must be >= 0, got {t.weight_decay}"))
    for key, p in (("tools.profile", cfg.tools.profile), ("tools.memory_profile", cfg.tools.memory_profile)):
        if p.enable and p.end_step > t.train_iters:
            errors.append(ConfigError(
                f"{key}.end_step",
                f"{p.end_step} is past training.train_iters ({t.train_iters}); profile steps within the run",
            ))
    return errors


def check_sections(cfg: Config) -> None:
    """Rules that span sections (no world size needed)."""
    t, m = cfg.training, cfg.model
    if t.init_model_with_meta_device and not t.load and (m.random_init or not m.model_name_or_path):
        raise ConfigError(
            "training.init_model_with_meta_device",
            "true needs training.load (an HF directory with load_format: hf, or a DCP directory from "
            "`mm-convert ... hf_to_dcp`) or model.model_name_or_path with safetensors; a meta build has no random init",
        )
    if t.val_interval and not has_eval_data(cfg.data):
        raise ConfigError(
            "training.val_interval",
            f"{t.val_interval} needs evaluation data: set data.dataset_param.basic_parameters.eval_dataset "
            "(MindSpeed-MM: data.val_dataset_param), or set val_interval to 0",
        )
    if t.eval_on_start and not has_eval_data(cfg.data):
        raise ConfigError(
            "training.eval_on_start",
            "true needs evaluation data: set data.dataset_param.basic_parameters.eval_dataset (or a synthetic "
            "dataset's num_eval), or set eval_on_start to false",
        )
    for sink, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if sink in cfg.tools.report_to and importlib.util.find_spec(module) is None:
            raise ConfigError(
                "tools.report_to",
                f"{sink} needs the {module} package: install the extra, `pip install 'mmfsdp-train[metrics]'` "
                "(a checkout: `uv sync`), or leave it out",
            )
    if t.save_format == "hf" and not m.model_name_or_path:
        raise ConfigError(
            "training.save_format",
            "hf needs model.model_name_or_path: the export copies config.json and the tokenizer from there",
        )
    objective_class(t.stage).check_config(cfg)  # the stage's own rules (`mmfsdp.train.objective`)
    if cfg.data.dataloader_param.balance and cfg.data.dataset_param.basic_parameters.packing and t.micro_batch_tokens is None:
        raise ConfigError(
            "data.dataloader_param.balance",
            "with packing, balance needs training.micro_batch_tokens (each micro-batch is then one packed row of at "
            "most that many tokens)",
        )


def check_world(cfg: Config, world_size: int) -> MeshPlan:
    """Checks that need the world size; returns the mesh plan. Runs before process groups start.

    The mesh (CP and EP sizes dividing the world, see `MeshPlan`); with context or
    expert parallel also the model (Ulysses size vs. attention heads, a MoE model
    whose expert count EP divides, via the model entry's `validate_parallel`) and,
    with context parallel and packing, `cutoff_len`: every packed sample is
    padded to `required_multiple(ring, ulysses)`, so rows of `cutoff_len` tokens
    must be a multiple of it. The padding multiple needs no check: the trainer
    takes its least common multiple with `required_multiple`.
    """
    plan = MeshPlan.from_config(cfg.parallel, world_size)
    if plan.cp > 1 or plan.ep > 1:
        get_model_entry(cfg.model.model_id).validate_parallel(cfg.model, plan)
    if plan.cp > 1:
        if cfg.data.dataset_param.basic_parameters.packing:
            validate_sequence_multiple(
                cfg.data.dataset_param.preprocess_parameters.cutoff_len, plan.ring, plan.ulysses,
                "data.dataset_param.preprocess_parameters.cutoff_len",
            )
    return plan


def save_resolved(cfg: Config, output_dir: str | Path) -> Path:
    """Write the resolved config as `<output_dir>/config.yaml`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(dump_yaml(cfg))
    return path
