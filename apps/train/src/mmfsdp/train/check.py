"""The deep check: everything that can be checked without a process group, every problem at once.

`deep_check(cfg, world_size)` returns a list of `ConfigError`s, each naming its
key path; an empty list means the run can start. It is what `apps/train --check`
prints, and the app runs it again before any process group starts, so a
mistake that would fail on every rank a minute into the run is one line each,
printed once, before any process group exists.

What it checks, in order (a step that cannot run because an earlier one failed
is skipped, not reported twice):

1. The world size against the mesh and context parallel (`check_world`).
2. Registry names: template, image plugin, collator, dataset type; dataset files
   and `dataset_dir` when the data is the user's files (`check_dataset`).
3. The attention backend on this host (`flash_attention_2` needs `flash_attn`).
4. Where the weights come from (`plan_start`, the trainer's own rule) and that
   they exist: safetensors in an HF directory, a DCP tracker or `.metadata`.
5. The model, built on the meta device from `config.json` (no weights read,
   no memory used): every pattern of `model.freeze`,
   `parallel.fsdp_plan.apply_modules`, `parallel.recompute_plan.apply_modules`
   and `features.activation_offload_plan.apply_modules` must match a module
   (the same matcher the trainer uses, with the closest module names), and the
   freeze list must leave a parameter to train; with `training.lora`, every
   target must name `nn.Linear` modules (not `lm_head`), some outside the frozen
   modules, and `pretrained_lora_path` must be a PEFT adapter directory.
   The template, image plugin and collator must be ones the model family
   declares, and packing a capability it declares (`mmfsdp.model.check_data`).
6. `training.output_dir`, `training.save` and the data cache directory are
   writable, or creatable (nothing is created).
7. The checkpoints step 4 found fit the model of step 5: keys and shapes from
   DCP `.metadata` or safetensors headers, through the family's state-dict
   adapter, never tensor data (`mmfsdp.train.check_ckpt`).

`media_setting_lines(cfg)` is the report's part on the data: the image and video settings the
data plugin will apply, each with where its value came from (`mmfsdp.data.media_settings`).

It is two halves so that a launcher need not import the model code:
`host_check` (steps 1, 2 and 6: no transformers, no model) and `model_check`
(steps 3–5 and 7). The app's own launcher runs `host_check` before it starts the
ranks, and its ranks run `model_check` before `init_process_group` (they import
the model code anyway); `--check`, a single process and plain torchrun run both.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from mmfsdp.config import ConfigError
from mmfsdp.train.config import Config, check_world

__all__ = ["deep_check", "host_check", "kernel_setting_lines", "media_setting_lines", "model_check"]


def media_setting_lines(cfg: Config) -> list[str]:
    """The effective image and video settings with their sources (config, model directory file, transformers
    default), or one line saying why they cannot be read yet (synthetic data writes its processor at start)."""
    from mmfsdp.data import DataError, media_settings

    try:
        settings = media_settings(cfg.data)
    except (ConfigError, DataError, OSError, ValueError) as err:  # transformers: OSError, ValueError for bad files
        return [f"media settings: not resolved ({err})"]
    return ["media settings (preprocess_parameters; value, and where it came from):", *(f"  {s}" for s in settings)]


def kernel_setting_lines(cfg: Config) -> list[str]:
    """The family's kernel choices on this host (`ModelEntry.kernel_lines`: e.g. which Gated DeltaNet kernel runs)."""
    from mmfsdp.model import get_model_entry
    from mmfsdp.parallel.device import detect_device_type

    if cfg.model.model_id is None:
        return []
    return get_model_entry(cfg.model.model_id).kernel_lines(cfg.model, detect_device_type())


def deep_check(cfg: Config, world_size: int) -> list[ConfigError]:
    """All problems of `cfg` on `world_size` processes that show without a process group."""
    return host_check(cfg, world_size) + model_check(cfg)


def host_check(cfg: Config, world_size: int) -> list[ConfigError]:
    """The checks that need neither the model code nor the weights: world size, names, data, directories."""
    errors: list[ConfigError] = []
    _collect(errors, check_world, cfg, world_size)
    errors += _registry_names(cfg)
    errors += _data_paths(cfg)
    errors += _writable_dirs(cfg)
    return errors


def model_check(cfg: Config) -> list[ConfigError]:
    """The checks that import the model code: attention backend, weights, and the module patterns (meta build)."""
    from mmfsdp.train.check_ckpt import checkpoint_check

    errors: list[ConfigError] = []
    model_cfg = _attention(cfg, errors)
    weight_errors, plan = _weights(cfg)
    errors += weight_errors
    entry, model = _build_meta(cfg, model_cfg, errors)
    if model is not None:
        errors += _model_patterns(cfg, entry, model)
        if plan is not None and not weight_errors:
            errors += checkpoint_check(cfg, plan, entry, model)
    errors += _router(cfg)
    errors += _family_data(cfg)
    return errors


def _family_data(cfg: Config) -> list[ConfigError]:
    """Template, image plugin and collator must be ones the model family lists, and packing and a video column
    (`attr.videos`) ones it supports (`mmfsdp.model.check_data`); context and expert parallel are the entry's
    `validate_parallel` (step 1). An
    unknown name is left to `_registry_names`, an unknown model id to the model section."""
    from mmfsdp.data import get_collator, get_plugin, get_template
    from mmfsdp.model import check_data, get_model_entry

    def registered(get, name: str | None) -> str | None:
        """The registered name `name` selects (an alias resolved), or None if it selects nothing."""
        found = _collect([], get, name) if name is not None else None
        return found.name if found is not None else None

    try:
        entry = get_model_entry(cfg.model.model_id)
    except ConfigError:
        return []
    pre = cfg.data.dataset_param.preprocess_parameters
    template = registered(get_template, pre.template)
    plugin = pre.image_plugin
    if plugin is None and template is not None:
        plugin = get_template(template).default_plugin
    return check_data(
        entry,
        template=template,
        image_plugin=registered(get_plugin, plugin),
        collator=registered(get_collator, cfg.data.dataloader_param.collate_param.model_name),
        packing=cfg.data.dataset_param.basic_parameters.packing,
        videos=cfg.data.dataset_param.attr.videos is not None,
        padding_free=bool(cfg.data.dataloader_param.padding_free),
    )


def _router(cfg: Config) -> list[ConfigError]:
    """`router_aux_loss_coef` needs a family with routers (a MoE model)."""
    from mmfsdp.model import get_model_entry

    coef = cfg.features.loss_cfg.router_aux_loss_coef
    try:
        entry = get_model_entry(cfg.model.model_id)
    except ConfigError:
        return []  # the unknown model id is reported by the model section itself
    if coef and not entry.router_modules:
        return [ConfigError(
            "features.loss_cfg.router_aux_loss_coef",
            f"{coef} needs a mixture-of-experts model, but model_id {cfg.model.model_id!r} is dense; set it to 0",
        )]
    return []


def _collect(errors: list[ConfigError], check, *args, **kwargs) -> object:
    """Run `check(*args, **kwargs)`, adding its `ConfigError` (or several) to `errors`; its result, or None."""
    try:
        return check(*args, **kwargs)
    except ConfigError as err:
        errors.extend(getattr(err, "errors", [err]))
        return None


def _registry_names(cfg: Config) -> list[ConfigError]:
    from mmfsdp.data import get_collator, get_plugin, get_template

    errors: list[ConfigError] = []
    pre = cfg.data.dataset_param.preprocess_parameters
    template = _collect(errors, get_template, pre.template)
    if pre.image_plugin is not None:
        _collect(errors, get_plugin, pre.image_plugin)
    elif template is not None:
        _collect(errors, get_plugin, template.default_plugin)
    _collect(errors, get_collator, cfg.data.dataloader_param.collate_param.model_name)
    return errors


def _data_paths(cfg: Config) -> list[ConfigError]:
    """Dataset type and files (the data package's own check), and for user files their root and processor."""
    from mmfsdp.data import DataError
    from mmfsdp.data.dataset import check_dataset

    errors: list[ConfigError] = []
    try:
        check_dataset(cfg.data)
    except ConfigError as err:
        errors.append(err)
    except DataError as err:
        errors.append(ConfigError("data.dataset_param.basic_parameters.dataset", str(err)))
    param = cfg.data.dataset_param
    basic = param.basic_parameters
    if basic.dataset is not None:  # generated data (synthetic_shapes) creates these itself
        if not Path(basic.dataset_dir).expanduser().is_dir():
            errors.append(ConfigError(
                "data.dataset_param.basic_parameters.dataset_dir",
                f"{basic.dataset_dir} is not a directory; image paths are resolved against it",
            ))
        processor_dir = param.preprocess_parameters.model_name_or_path
        if processor_dir is None or not Path(processor_dir).expanduser().is_dir():
            errors.append(ConfigError(
                "data.dataset_param.preprocess_parameters.model_name_or_path",
                f"{processor_dir!r} is not a directory; give the local model directory with the tokenizer and image processor",
            ))
    return errors


def _attention(cfg: Config, errors: list[ConfigError]):
    """Check the backend on this host; the model config to build with (sdpa when the backend is missing,
    so the pattern checks still run)."""
    from mmfsdp.model import resolve_attention_backend
    from mmfsdp.parallel import detect_device_type

    if _collect(errors, resolve_attention_backend, cfg.model.attn_implementation, detect_device_type()) is None:
        return dataclasses.replace(cfg.model, attn_implementation="sdpa")
    return cfg.model


def _weights(cfg: Config) -> tuple[list[ConfigError], object]:
    """What the run will load (`plan_start`, as the trainer applies it) exists and is complete; the problems,
    and the `StartPlan` (None when it cannot be made)."""
    from mmfsdp.ckpt import CheckpointError
    from mmfsdp.model import safetensors_problem
    from mmfsdp.train.start import plan_start

    t = cfg.training
    load_is_save = t.load is not None and t.save is not None and Path(t.load).resolve() == Path(t.save).resolve()
    if t.load is not None and not load_is_save and not Path(t.load).exists():  # load == save: the first run has none yet
        what = "an HF directory" if t.load_format == "hf" else "a DCP checkpoint directory"
        return [ConfigError("training.load", f"{t.load} does not exist; give {what}, or remove training.load")], None
    try:
        plan = plan_start(t, cfg.model)
    except ConfigError as err:
        return [err], None
    except CheckpointError as err:
        return [ConfigError("training.load" if t.load else "training.save", str(err))], None
    key = {"hf": "training.load", "pretrained": "model.model_name_or_path"}.get(plan.weights)
    if key is None:  # a checkpoint or release verified by plan_start, or random weights
        return [], plan
    if not Path(plan.source).is_dir():
        return [ConfigError(key, f"{plan.source} is not a directory of HF weights")], plan
    problem = safetensors_problem(plan.source)
    if problem is not None:
        hint = "set model.random_init: true to train from random weights" if key == "model.model_name_or_path" else "point at the HF weights"
        return [ConfigError(key, f"{problem}; {hint}")], plan
    return [], plan


def _build_meta(cfg: Config, model_cfg, errors: list[ConfigError]):
    """(entry, model built on the meta device); None for what cannot be made (its problem added to `errors`)."""
    import torch

    from mmfsdp.model import get_model_entry

    entry = _collect(errors, get_model_entry, cfg.model.model_id)
    if entry is None:
        return None, None
    return entry, _collect(errors, lambda: entry.build(model_cfg, cfg.features, device=torch.device("meta")))


def _model_patterns(cfg: Config, entry, model) -> list[ConfigError]:
    """Match every module pattern of the config against the meta-built `model`."""
    from mmfsdp.model import resolve_lora_targets
    from mmfsdp.model.parallelize import expert_parallel_patterns, fsdp_patterns
    from mmfsdp.parallel.expert_parallel import check_experts_module

    errors: list[ConfigError] = []
    recompute = cfg.parallel.recompute_plan.apply_modules
    fsdp_key, fsdp = fsdp_patterns(entry, cfg.parallel)
    lists = [
        ("model.freeze", cfg.model.freeze),
        (fsdp_key, list(fsdp)),
        ("features.activation_offload_plan.apply_modules", cfg.features.activation_offload_plan.apply_modules or []),
    ]
    if cfg.parallel.ep_plan.apply_modules is not None or cfg.parallel.expert_parallel_size > 1:
        ep_key, ep_patterns = expert_parallel_patterns(entry, cfg.parallel)
        lists.append((ep_key, list(ep_patterns)))
    if cfg.parallel.recompute:
        lists.append(("parallel.recompute_plan.apply_modules", recompute) if recompute is not None
                     else ("parallel.recompute_plan.apply_modules (model default)", list(entry.recompute_modules)))
    frozen: set[str] = set()
    for key, patterns in lists:
        for i, pattern in enumerate(patterns):
            names = _match_one(model, pattern, f"{key}[{i}]", errors)
            if key == "model.freeze":
                frozen.update(names)
            elif key.startswith("parallel.ep_plan"):
                problems: list[ConfigError] = []
                for name in names:
                    _collect(problems, check_experts_module, name, model.get_submodule(name), f"{key}[{i}]")
                errors += problems[:1]  # one line per pattern: its first module that is not fused experts

    def outside_frozen(name: str) -> bool:
        return not any(name == module or name.startswith(module + ".") for module in frozen)

    lora = cfg.training.lora
    if lora.enable:
        targets = _collect(errors, resolve_lora_targets, model, list(lora.target_modules), entry)
        if targets and not any(outside_frozen(name) for name in targets):
            errors.append(ConfigError("model.freeze", "freezes every LoRA target module (training.lora.target_modules); "
                                                      "leave some adapters to train"))
        errors += _pretrained_lora(lora.pretrained_lora_path)
    elif frozen and not any(outside_frozen(name) for name, _ in model.named_parameters()):
        errors.append(ConfigError("model.freeze", "freezes every parameter of the model; leave something to train"))
    return errors


def _pretrained_lora(path: str | None) -> list[ConfigError]:
    from mmfsdp.ckpt import CheckpointError
    from mmfsdp.ckpt.lora import read_peft_config

    if path is None:
        return []
    try:
        read_peft_config(path)
    except CheckpointError as err:
        return [ConfigError("training.lora.pretrained_lora_path", str(err))]
    return []


def _match_one(model, pattern: str, key: str, errors: list[ConfigError]) -> list[str]:
    """The modules `pattern` matches; none is an error under `key` naming the closest modules."""
    from mmfsdp.parallel.patterns import match_module_names

    try:
        return match_module_names(model, [pattern], key=key)
    except ConfigError as err:
        errors.append(ConfigError(key, err.message))
        return []


def _writable_dirs(cfg: Config) -> list[ConfigError]:
    cache_dir = cfg.data.dataset_param.basic_parameters.cache_dir
    dirs = [("training.output_dir", cfg.training.output_dir), ("training.save", cfg.training.save)]
    dirs.append(("data.dataset_param.basic_parameters.cache_dir", cache_dir or str(Path.home() / ".cache" / "mmfsdp" / "data")))
    errors = []
    for key, path in dirs:
        if path is not None and (problem := _not_writable(Path(path).expanduser())) is not None:
            errors.append(ConfigError(key, problem))
    return errors


def _not_writable(path: Path) -> str | None:
    """None when `path` is a writable directory or could be created; else why not. Creates nothing."""
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable; choose another directory"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable; choose another directory"
    return None
